"""GRPO math as pure tensor functions: group-relative advantages and the clipped policy-gradient loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


def advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
               batch_std: float | None = None) -> torch.Tensor:
    """(r - group mean), divided by the group std (``group``), the batch std (``batch``) or nothing (``none``).

    ``rewards`` holds consecutive groups of ``group_size`` completions of the same prompt. ``batch_std`` is the std
    over the global batch (all ranks); by default the std of ``rewards``.
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"grpo_scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale!r}")
    grouped = rewards.view(-1, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        std = grouped.std(dim=1, unbiased=True).repeat_interleave(group_size) if group_size > 1 else torch.ones_like(rewards)
        return centred / (std + eps)
    if scale == "batch":
        if batch_std is None:
            batch_std = float(rewards.std(unbiased=True)) if rewards.numel() > 1 else 0.0
        return centred / (batch_std + eps)
    return centred


@dataclass
class LossParts:
    loss: torch.Tensor
    kl: float
    clip_ratio: float


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    eps_low: float,
    eps_high: float,
    loss_type: str,
    max_completion_length: int,
    total_tokens: float | None = None,
) -> LossParts:
    """Clipped surrogate with an optional k3 KL term, aggregated per ``loss_type``.

    Shapes: (N, T) for log-probs and ``mask`` (1 for completion tokens), (N,) for ``adv``. ``grpo``: mean over each
    sequence's tokens, then over sequences; ``bnpo``: token mean over this batch; ``dapo``: token sum over
    ``total_tokens`` (the global count of completion tokens, for equal token weight across ranks and micro-batches);
    ``dr_grpo``: token sum over N * max_completion_length.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo_loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    a = adv.unsqueeze(1)
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
    per_token = -torch.min(unclipped, clipped)
    kl = torch.zeros_like(logps)
    if ref_logps is not None and beta != 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    tokens = mask.sum().clamp(min=1.0)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / tokens
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / (total_tokens if total_tokens else tokens)
    else:
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    is_clipped = ((ratio < 1 - eps_low) & (a < 0)) | ((ratio > 1 + eps_high) & (a > 0))
    return LossParts(
        loss=loss,
        kl=float((kl * mask).sum() / tokens),
        clip_ratio=float((is_clipped.to(mask.dtype) * mask).sum() / tokens),
    )
