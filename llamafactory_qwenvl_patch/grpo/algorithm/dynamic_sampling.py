"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2; verl ``filter_groups``, ms-swift ``dynamic_sample``): a
group whose completions all score alike has no advantage and teaches nothing, so it is replaced by a group of a
freshly drawn prompt, until the batch is full or the resampling budget is spent. Pure helpers; the trainer's
``RefillMixin`` samples and swaps.

Decisions: replacements are drawn uniformly (with replacement) from the whole training set by a generator seeded
with (seed, rank, micro-step, attempt), so a resumed run draws the same ones without extra checkpoint state; each
attempt samples one micro-batch of prompts on every rank while any rank still has a flat group (ranks sample in
step: ZeRO-3 generation and tensor-parallel engines are collective); a batch still short when the budget is spent
keeps its flat groups (their advantages are 0 with the grpo and rloo estimators; REINFORCE++'s batch whitening
gives them the batch's offset) and says so in ``dynamic/short_groups``; the blank copy of a prompt swapped out
leaves with it.
"""

from __future__ import annotations

import torch


def fresh_indices(dataset_size: int, count: int, seed: int, rank: int, micro_step: int, attempt: int) -> list[int]:
    """``count`` dataset indices for one resampling attempt: the same for the same run position on every replay."""
    key = ((seed * 1_000_003 + rank) * 1_000_003 + micro_step) * 1_009 + attempt
    generator = torch.Generator().manual_seed(key % (2**63))
    return torch.randint(dataset_size, (count,), generator=generator).tolist()


def flat_groups(totals: torch.Tensor, group_size: int, tol: float = 1e-6) -> list[bool]:
    """Per prompt: every one of its ``group_size`` completions got the same total reward."""
    grouped = totals.view(-1, group_size)
    return ((grouped.max(dim=1).values - grouped.min(dim=1).values) <= tol).tolist()
