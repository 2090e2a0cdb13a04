"""Advantage estimators as pure tensor functions: one advantage per completion from its outcome reward.

``rewards`` always holds consecutive groups of ``group_size`` completions of the same prompt.

- ``grpo``: (r - group mean), scaled by the group std, the batch std or nothing (``grpo_scale_rewards``);
- ``rloo``: r minus the mean of the *other* completions of its group, i.e. ``G/(G-1) (r - group mean)``
  (Ahmadian et al. 2024; verl ``compute_rloo_outcome_advantage``);
- ``reinforce_plus_plus``: the outcome reward whitened over every completion token of the global batch, no group
  baseline (Hu 2025; verl ``compute_reinforce_plus_plus_outcome_advantage`` with gamma 1);
- ``reinforce_plus_plus_baseline``: the group mean subtracted first, then whitened the same way (verl
  ``compute_reinforce_plus_plus_baseline_outcome_advantage``).

verl whitens per token (``masked_whiten``: a token-weighted mean and unbiased variance), so a completion counts as
many times as it has tokens; ``batch_moments`` gives those sums, which the trainer adds over ranks first.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
SCALE_REWARDS = ("group", "batch", "none")
WHITEN_EPS = 1e-8  # verl's masked_whiten


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     batch_std: float | None = None) -> torch.Tensor:
    """(r - group mean), divided by the group std (``group``), the batch std (``batch``) or nothing (``none``).
    ``batch_std`` is the std over the global batch (all ranks); by default the std of ``rewards``."""
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


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean_{j != i} r_j. A group of one has baseline 0 (verl's rule)."""
    if group_size == 1:
        return rewards.clone()
    grouped = rewards.view(-1, group_size)
    return ((grouped - grouped.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)).view(-1)


def outcome_values(rewards: torch.Tensor, group_size: int, estimator: str) -> torch.Tensor:
    """What REINFORCE++ whitens: the reward, or (``_baseline``) the reward minus its group mean."""
    if estimator == "reinforce_plus_plus_baseline":
        grouped = rewards.view(-1, group_size)
        return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    return rewards


def batch_moments(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(tokens, sum of v x tokens, sum of v^2 x tokens) of one rank's completions: summed over ranks, they give the
    token-weighted mean and variance of the global batch."""
    values, weights = values.double(), lengths.double()  # float64: the variance is E[v^2] - E[v]^2
    return torch.stack([weights.sum(), (values * weights).sum(), (values * values * weights).sum()])


def whitened(values: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """``values`` whitened by the global token-weighted ``moments`` (``batch_moments`` summed over ranks): verl's
    ``masked_whiten`` (unbiased variance, + 1e-8 under the root) over every completion token of the batch."""
    tokens, total, squares = (float(m) for m in moments)
    if tokens < 2:
        return values - (total / tokens if tokens else 0.0)
    mean = total / tokens
    variance = (squares / tokens - mean * mean) * tokens / (tokens - 1)
    return (values - mean) * torch.rsqrt(torch.tensor(max(variance, 0.0) + WHITEN_EPS, dtype=values.dtype))


def zero_std_groups(rewards: torch.Tensor, group_size: int, tol: float = 1e-6) -> torch.Tensor:
    """(N,) bool: the completion belongs to a group whose rewards are all equal (no learning signal)."""
    grouped = rewards.view(-1, group_size)
    flat = (grouped.max(dim=1).values - grouped.min(dim=1).values) <= tol
    return flat.repeat_interleave(group_size)
