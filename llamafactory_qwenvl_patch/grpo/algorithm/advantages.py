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

from dataclasses import dataclass
from typing import Callable, Literal, Protocol

import torch

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


class Ranks(Protocol):
    """What an estimator may ask of the other ranks: the global batch is every rank's completions."""

    several: bool  # more than one rank

    def gather(self, values: torch.Tensor) -> torch.Tensor: ...  # every rank's values, concatenated

    def sum(self, values: torch.Tensor) -> torch.Tensor: ...  # summed over ranks


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: ``advantages(rewards, lengths, group_size, scale, ranks)`` gives one advantage per
    completion; ``group_baseline``: its advantages are 0 in a group whose rewards are all equal (the run warns when
    every group is flat); ``takes_scale``: it reads ``grpo_scale_rewards``; ``reduces``: how its batch statistics
    cross ranks (``none``, ``gather``: the rewards gathered, ``sum``: moments summed)."""

    name: str
    advantages: Callable[[torch.Tensor, torch.Tensor, int, str, Ranks], torch.Tensor]
    group_baseline: bool
    takes_scale: bool
    reduces: Literal["none", "gather", "sum"]


ESTIMATOR_REGISTRY: dict[str, Estimator] = {}


def register_estimator(name: str, *, group_baseline: bool, takes_scale: bool = False,
                       reduces: Literal["none", "gather", "sum"] = "none") -> Callable:
    """Decorator: the function becomes the estimator ``grpo_advantage_estimator: name`` (verl's
    ``register_adv_est``); a new estimator is this one function."""
    def add(fn: Callable[[torch.Tensor, torch.Tensor, int, str, Ranks], torch.Tensor]) -> Callable:
        if name in ESTIMATOR_REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is registered already")
        ESTIMATOR_REGISTRY[name] = Estimator(name, fn, group_baseline, takes_scale, reduces)
        return fn
    return add


def estimator(name: str) -> Estimator:
    if name not in ESTIMATOR_REGISTRY:
        raise ValueError(f"grpo_advantage_estimator must be one of {', '.join(ESTIMATOR_REGISTRY)}, got {name!r}")
    return ESTIMATOR_REGISTRY[name]


@register_estimator("grpo", group_baseline=True, takes_scale=True, reduces="gather")
def _grpo(rewards: torch.Tensor, lengths: torch.Tensor, group_size: int, scale: str, ranks: Ranks) -> torch.Tensor:
    """``batch`` scale: the std over every rank's rewards."""
    batch_std = float(ranks.gather(rewards).std()) if scale == "batch" and ranks.several else None
    return group_advantages(rewards, group_size, scale, batch_std=batch_std)


@register_estimator("rloo", group_baseline=True)
def _rloo(rewards: torch.Tensor, lengths: torch.Tensor, group_size: int, scale: str, ranks: Ranks) -> torch.Tensor:
    return rloo_advantages(rewards, group_size)


def _whitened_over_ranks(values: torch.Tensor, lengths: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    moments = batch_moments(values, lengths).to(values.device)
    return whitened(values, ranks.sum(moments) if ranks.several else moments)


@register_estimator("reinforce_plus_plus", group_baseline=False, reduces="sum")
def _reinforce_pp(rewards: torch.Tensor, lengths: torch.Tensor, group_size: int, scale: str, ranks: Ranks
                  ) -> torch.Tensor:
    return _whitened_over_ranks(rewards, lengths, ranks)


@register_estimator("reinforce_plus_plus_baseline", group_baseline=True, reduces="sum")
def _reinforce_pp_baseline(rewards: torch.Tensor, lengths: torch.Tensor, group_size: int, scale: str, ranks: Ranks
                           ) -> torch.Tensor:
    grouped = rewards.view(-1, group_size)
    return _whitened_over_ranks((grouped - grouped.mean(dim=1, keepdim=True)).view(-1), lengths, ranks)


def zero_std_groups(rewards: torch.Tensor, group_size: int, tol: float = 1e-6) -> torch.Tensor:
    """(N,) bool: the completion belongs to a group whose rewards are all equal (no learning signal)."""
    grouped = rewards.view(-1, group_size)
    flat = (grouped.max(dim=1).values - grouped.min(dim=1).values) <= tol
    return flat.repeat_interleave(group_size)
