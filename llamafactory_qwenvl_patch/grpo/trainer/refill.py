"""DAPO's dynamic sampling in ``GRPOTrainer`` (``grpo_dynamic_sampling``): the flat groups of a sampled rollout are
swapped for groups of freshly drawn prompts before its training inputs are built (rules in ``dynamic_sampling``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llamafactory_qwenvl_patch.grpo.algorithm.dynamic_sampling import flat_groups, fresh_indices
from llamafactory_qwenvl_patch.grpo.rewards.registry import Scored, pick_scored
from llamafactory_qwenvl_patch.grpo.rollout.tensors import stack_rows
from llamafactory_qwenvl_patch.grpo.rollout.types import SampledPart


@dataclass
class ScoredPart:
    """A sampled part, its real (not blank-copy) prompts' positions, each reward's values over their completions and
    which of those prompts' groups are flat (one total reward for every completion)."""

    part: SampledPart
    real: list[int]
    results: list[Scored]
    flat: list[bool]


class RefillMixin:
    def _scored_part(self, part: SampledPart) -> ScoredPart:
        G = self.num_generations
        real = [i for i, sample in enumerate(part.meta) if not sample.blank]
        rows = [i * G + g for i in real for g in range(G)]
        lengths = part.attention.sum(dim=1).tolist()
        results = self._reward_results([part.texts[r] for r in rows], [part.meta[i] for i in real],
                                       [int(lengths[r]) for r in rows])
        total = self._weighted_total(results, len(rows))
        return ScoredPart(part, real, results, flat_groups(total, G) if rows else [])

    def _any_rank(self, flag: bool) -> bool:
        if self.accelerator.num_processes == 1:
            return flag
        value = torch.tensor([int(flag)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(value, reduction="sum").item())

    def _refill(self, model: Any, parts: list[SampledPart], per_micro: int) -> tuple[list[SampledPart], list[Scored]]:
        """The sampled ``parts`` with their flat groups replaced by non-flat groups of fresh prompts (at most
        ``grpo_max_resample`` extra micro-batches of prompts), and each reward's values over the final real
        completions in order."""
        G = self.num_generations
        sources = [self._scored_part(part) for part in parts]
        slots = [(j, k) for j, source in enumerate(sources) for k, flat in enumerate(source.flat) if flat]
        candidates: list[tuple[int, int]] = []
        attempts = 0
        while attempts < self.grpo_args.grpo_max_resample and self._any_rank(len(slots) > len(candidates)):
            indices = fresh_indices(len(self.train_dataset), per_micro, self.args.seed, self.args.process_index,
                                    self.run_state.micro_step, attempts)
            attempts += 1
            sources.append(self._scored_part(self._sample_part(model, [self.train_dataset[i] for i in indices])))
            candidates += [(len(sources) - 1, k) for k, flat in enumerate(sources[-1].flat) if not flat]
        swaps = dict(zip(slots, candidates))
        refilled = [self._swapped(sources, j, swaps) if any(slot[0] == j for slot in swaps) else part
                    for j, part in enumerate(parts)]
        rows = []
        for j in range(len(parts)):
            for k in range(len(sources[j].real)):
                source, kk = swaps.get((j, k), (j, k))
                rows += [(source, kk * G + g) for g in range(G)]
        self.run_state.metrics["dynamic/replaced_groups"].append(float(len(swaps)))
        self.run_state.metrics["dynamic/short_groups"].append(float(len(slots) - len(swaps)))
        self.run_state.metrics["dynamic/resampled_batches"].append(float(attempts))
        return refilled, pick_scored([source.results for source in sources], rows)

    def _swapped(self, sources: list[ScoredPart], j: int, swaps: dict[tuple[int, int], tuple[int, int]]
                 ) -> SampledPart:
        """Part ``j`` with each swapped prompt (and its G sampled completions) taken from its source part; the blank
        copy of a prompt swapped out leaves with it (the blank control compares a copy with its original); the
        prompts are collated again, so every tensor of the part comes from one collation."""
        G = self.num_generations
        part = sources[j].part
        features, picks = list(part.features), [(part, position) for position in range(len(part.meta))]
        real, gone = sources[j].real, set()
        for k, position in enumerate(real):
            if (j, k) in swaps:
                source, kk = swaps[(j, k)]
                donor, donor_position = sources[source].part, sources[source].real[kk]
                features[position] = donor.features[donor_position]
                picks[position] = (donor, donor_position)
                gone.add(part.meta[position].index)
        kept = {part.meta[position].index for k, position in enumerate(real) if (j, k) not in swaps}
        keep = [position for position, sample in enumerate(part.meta)
                if not (sample.blank and sample.index in gone and sample.index not in kept)]
        features, picks = [features[p] for p in keep], [picks[p] for p in keep]
        batch, meta = self._collate(features)
        if "image_grid_thw" in batch:
            self._check_blank_frame(batch, meta)
        rows = [(donor, position * G + g) for donor, position in picks for g in range(G)]
        sampling = None
        if part.sampling_logps is not None:
            sampling = stack_rows([donor.sampling_logps[r:r + 1] for donor, r in rows], 0.0)
        return SampledPart(features, batch, meta, texts=[donor.texts[r] for donor, r in rows],
                           ids=stack_rows([donor.ids[r:r + 1] for donor, r in rows], self.tokenizer.pad_token_id),
                           attention=stack_rows([donor.attention[r:r + 1] for donor, r in rows], 0),
                           stopped=torch.stack([donor.stopped[r] for donor, r in rows]), sampling_logps=sampling)
