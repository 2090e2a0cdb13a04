"""GRPO math as pure tensor functions: group-relative advantages, step normalisers and the clipped loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")


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


def zero_std_groups(rewards: torch.Tensor, group_size: int, tol: float = 1e-6) -> torch.Tensor:
    """(N,) bool: the completion belongs to a group whose rewards are all equal (no learning signal)."""
    grouped = rewards.view(-1, group_size)
    flat = (grouped.max(dim=1).values - grouped.min(dim=1).values) <= tol
    return flat.repeat_interleave(group_size)


def micro_batch_counts(masks: list[torch.Tensor]) -> torch.Tensor:
    """(micro-batches, 2): completion tokens and sequences entering the loss in each micro-batch's loss mask."""
    return torch.tensor([[float(m.sum()), float((m.sum(dim=1) > 0).sum())] for m in masks])


def step_normalizers(counts: torch.Tensor, grad_accum: int, world_size: int) -> torch.Tensor:
    """Per micro-batch (tokens, sequences) normalisers that make a token or sequence mean over the optimiser step.

    ``counts`` is ``micro_batch_counts`` of one rollout, summed over all ranks; consecutive runs of ``grad_accum`` micro-batches form one optimiser step.
    transformers' Trainer divides each micro-batch loss by ``grad_accum`` and DDP / DeepSpeed average gradients over
    ranks, so a micro-batch that divides its sum by ``step total / (world_size * grad_accum)`` contributes exactly its
    share of the step's mean, whatever the sizes of the other micro-batches.
    """
    if counts.size(0) % grad_accum:
        raise ValueError(f"{counts.size(0)} micro-batches do not split into steps of {grad_accum}")
    per_step = counts.view(-1, grad_accum, 2).sum(dim=1).clamp(min=1.0)
    return (per_step / (world_size * grad_accum)).repeat_interleave(grad_accum, dim=0)


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
    token_normalizer: float | None = None,
    seq_normalizer: float | None = None,
    importance: str = "token",
    sampling_weights: torch.Tensor | None = None,
) -> LossParts:
    """Clipped surrogate with an optional k3 KL term, aggregated per ``loss_type``.

    Shapes: (N, T) for log-probs and ``mask`` (1 for completion tokens that enter the loss), (N,) for ``adv``.
    ``importance``: ``token`` ratios (GRPO) or one ratio per sequence from its mean log-ratio (GSPO).
    ``grpo``: mean over each sequence's tokens, summed over sequences and divided by ``seq_normalizer`` (default:
    the sequences of this batch that enter the loss); ``bnpo``: token mean over this batch; ``dapo``: token sum over
    ``token_normalizer`` (default: this batch's tokens); ``dr_grpo``: token sum over N * max_completion_length.
    ``step_normalizers`` gives the normalisers that make ``grpo`` and ``dapo`` means over a whole optimiser step.
    ``sampling_weights`` (N, T): truncated importance weights for a sampler that is not the training model (vLLM),
    applied to the policy term before the KL term is added, as trl does.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo_loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if importance not in IMPORTANCE_LEVELS:
        raise ValueError(f"grpo_importance_sampling must be one of {', '.join(IMPORTANCE_LEVELS)}, got {importance!r}")
    mask = mask.to(logps.dtype)
    seq_tokens = mask.sum(dim=1)
    log_ratio = logps - old_logps
    if importance == "sequence":
        log_ratio = ((log_ratio * mask).sum(dim=1) / seq_tokens.clamp(min=1.0)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    a = adv.unsqueeze(1)
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
    per_token = -torch.min(unclipped, clipped).expand_as(logps)
    if sampling_weights is not None:
        per_token = per_token * sampling_weights
    kl = torch.zeros_like(logps)
    if ref_logps is not None and beta != 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    tokens = mask.sum().clamp(min=1.0)
    summed = (per_token * mask).sum()
    if loss_type == "grpo":
        kept = float((seq_tokens > 0).sum().clamp(min=1))
        loss = ((per_token * mask).sum(dim=1) / seq_tokens.clamp(min=1.0)).sum() / (seq_normalizer or kept)
    elif loss_type == "bnpo":
        loss = summed / tokens
    elif loss_type == "dapo":
        loss = summed / (token_normalizer or tokens)
    else:
        loss = summed / (per_token.size(0) * max_completion_length)
    is_clipped = (((ratio < 1 - eps_low) & (a < 0)) | ((ratio > 1 + eps_high) & (a > 0))).expand_as(logps)
    return LossParts(
        loss=loss,
        kl=float((kl.detach() * mask).sum() / tokens),
        clip_ratio=float((is_clipped.to(mask.dtype) * mask).sum() / tokens),
    )
