"""Prompt order for GRPO: each rank's generation batch, repeated for every micro-step that optimises it."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


def check_prompt_count(num_prompts: int, per_rank: int, world_size: int) -> None:
    """ValueError unless the training set fills one generation batch (``per_rank`` prompts on each of the ranks):
    checked by the workflow as soon as the dataset is read, before the model loads, and by the sampler."""
    if num_prompts < per_rank * world_size:
        raise ValueError(f"the training set has {num_prompts} prompts but one generation batch needs "
                         f"{per_rank * world_size} (per_device_train_batch_size x grpo_steps_per_generation x ranks)")


class RolloutSampler(Sampler[int]):
    """Indices for a DataLoader whose batches are generation batches of ``per_rank`` prompts.

    A round draws ``per_rank * world_size`` distinct prompts (one chunk per rank) and yields the round ``repeats``
    times (``steps_per_generation * num_iterations``), so accelerate's round-robin batch sharding hands each rank its
    own chunk at every micro-step of the round: the trainer generates on the first and reuses the rollout after.
    An incomplete last round is dropped; shuffling is seeded per epoch (``set_epoch``), the same on every rank.
    """

    def __init__(self, num_prompts: int, per_rank: int, world_size: int, repeats: int, shuffle: bool = True,
                 seed: int = 0) -> None:
        self.round = per_rank * world_size
        check_prompt_count(num_prompts, per_rank, world_size)
        self.num_prompts, self.repeats, self.shuffle, self.seed = num_prompts, repeats, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_prompts // self.round * self.round * self.repeats

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            order = order.tolist()
        else:
            order = list(range(self.num_prompts))
        for start in range(0, self.num_prompts - self.round + 1, self.round):
            chunk = order[start:start + self.round]
            for _ in range(self.repeats):
                yield from chunk
