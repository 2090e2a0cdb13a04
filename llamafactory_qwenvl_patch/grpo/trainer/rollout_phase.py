"""The rollout half of ``GRPOTrainer``: batch the prompts, sample G completions each (HF ``generate`` or vLLM), score
them and turn one generation batch into the ``MicroBatch`` of every micro-step that optimises it."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader
from transformers import GenerationConfig
from transformers.trainer_utils import seed_worker

from llamafactory_qwenvl_patch.frame.mrope import token_types
from llamafactory_qwenvl_patch.grpo.algorithm.advantages import estimator, zero_std_groups
from llamafactory_qwenvl_patch.grpo.algorithm.losses import micro_batch_counts, step_normalizers
from llamafactory_qwenvl_patch.grpo.generation.gather_budget import zero3_budget
from llamafactory_qwenvl_patch.grpo.generation.hf import sample_shared_prefix
from llamafactory_qwenvl_patch.grpo.generation.settings import generation_config_of
from llamafactory_qwenvl_patch.grpo.generation.vllm_video import captured_videos, clips_per_sample
from llamafactory_qwenvl_patch.grpo.rewards.builtin import confident_answer
from llamafactory_qwenvl_patch.grpo.rewards.monitors import add_monitors, rollout_metrics
from llamafactory_qwenvl_patch.grpo.rewards.registry import Scored, reward_inputs, score
from llamafactory_qwenvl_patch.grpo.rollout import shared_prefix
from llamafactory_qwenvl_patch.grpo.rollout.collate import blank_copy, blankable
from llamafactory_qwenvl_patch.grpo.rollout.tensors import (
    completion_mask,
    cut_at_tokens,
    decode_kept,
    first_image_sizes,
    images_per_sample,
    repeat_values,
    repeat_visual,
    videos_per_sample,
)
from llamafactory_qwenvl_patch.grpo.rollout.types import MicroBatch, SampledPart, SampleMeta
from llamafactory_qwenvl_patch.grpo.trainer.prompt_order import RolloutSampler
from llamafactory_qwenvl_patch.grpo.trainer.state import AcceleratorRanks
from llamafactory_qwenvl_patch.image_io.images import model_input_image
from llamafactory_qwenvl_patch.scoring.answers import try_parse_items

GENERATION_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
                   "video_grid_thw", "second_per_grid_ts")
VISUAL = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))  # pixels, grid
FLAT_PATIENCE = 3  # rollouts in a row whose every group scored alike before the run warns that it learns nothing
logger = logging.getLogger("llamafactory.qwenvl_patch.grpo")


class RolloutMixin:
    # --- data ----------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """Batches of ``per_device_train_batch_size x grpo_steps_per_generation`` prompts, each repeated for every
        micro-step that optimises it (see ``RolloutSampler``)."""
        if self.train_dataset is None:
            raise ValueError("stage: grpo needs a training dataset")
        per_rank = self._train_batch_size * self.steps_per_generation
        sampler = RolloutSampler(len(self.train_dataset), per_rank, self.args.world_size,
                                 self.steps_per_generation * self.num_iterations, seed=self.args.seed)
        self.rollout_sampler = sampler
        loader = DataLoader(
            self.train_dataset, batch_size=per_rank, sampler=sampler, collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
            worker_init_fn=partial(seed_worker, num_workers=self.args.dataloader_num_workers,
                                   rank=self.args.process_index),
        )
        return self.accelerator.prepare(loader)

    def _collate(self, features: list[dict[str, Any]]) -> tuple[dict[str, Any], list[SampleMeta]]:
        videos = [len(feature.get("videos") or []) for feature in features]
        if self.vllm is None or not any(videos):
            batch, meta = self.data_collator.collate(features, self.drop_ids)
        else:  # the clips the plugin decodes for the loss, kept for vLLM
            with captured_videos(self.data_collator.collator.template.mm_plugin) as captured:
                batch, meta = self.data_collator.collate(features, self.drop_ids)
            clips = clips_per_sample(captured, videos, batch["video_grid_thw"].tolist())
            for sample, mine in zip(meta, clips):
                sample.videos = mine
        if self.vllm is not None:  # the exact images the loss sees, for vLLM
            for sample, feature in zip(meta, features):
                sample.images = [model_input_image(src, self.resize_policy) for src in feature.get("images") or []]
        if "second_per_grid_ts" in batch:  # LF's collator gives a list; generate's input expansion splits a tensor
            batch["second_per_grid_ts"] = torch.as_tensor(batch["second_per_grid_ts"], dtype=torch.float32)
        batch = self._prepare_input({k: v for k, v in batch.items() if k in GENERATION_KEYS})
        for _, grid in VISUAL:
            if grid in batch:
                per_sample = self._per_sample(batch, grid)
                for sample, hw in zip(meta, first_image_sizes(batch[grid], per_sample, self.grid_frame)):
                    sample.model_hw = sample.model_hw or hw  # a prompt's frame: its first image, else its first video
        return batch, meta

    def _per_sample(self, batch: dict[str, Any], grid: str) -> list[int]:
        """Images (``grid="image_grid_thw"``) or videos of each prompt in ``batch``."""
        if grid == "image_grid_thw":
            return images_per_sample(batch["input_ids"], self.vision_start_id, self.image_id)
        return videos_per_sample(batch["input_ids"], self.video_id, batch[grid], self.video_merge_length)

    @property
    def _ranks(self) -> AcceleratorRanks:
        return AcceleratorRanks(self.accelerator)

    @property
    def video_merge_length(self) -> int:
        """Patches per ``<|video_pad|>``: the vision config's spatial merge size squared."""
        return self.model.config.vision_config.spatial_merge_size ** 2

    # --- rollout -------------------------------------------------------------------------------------------------

    def _check_gather_budget(self, model: Any) -> None:
        """Once, before the first HF rollout under ZeRO-3 on a GPU: can every rank hold the whole model?"""
        self.run_state.gather_checked = True
        if not (self._zero3() and torch.cuda.is_available()):
            return
        budget = zero3_budget(self.accelerator.unwrap_model(model), self.accelerator.device)
        verdict = budget.verdict()
        if verdict is None:
            return
        level, message = verdict
        if level == "error":
            raise RuntimeError(f"stage: grpo: {message}")
        logging.getLogger("llamafactory.qwenvl_patch.grpo").warning(f"stage: grpo: {message}")

    @contextmanager
    def _generation_model(self, model: Any) -> Iterator[Any]:
        """The unwrapped model in eval mode under ``no_grad``; under ZeRO-3 with every parameter gathered on this
        rank and DeepSpeed's hooks removed, so that sampling in it is no collective (trl's
        ``unwrap_model_for_generation``). Entering it is one: every rank enters it together."""
        from trl.models import unwrap_model_for_generation

        if not self.run_state.gather_checked:
            self._check_gather_budget(model)
        with torch.no_grad(), unwrap_model_for_generation(
            model, self.accelerator, gather_deepspeed3_params=True
        ) as unwrapped:
            was_training = unwrapped.training
            unwrapped.eval()
            try:
                yield unwrapped
            finally:
                unwrapped.train(was_training)

    def _generate_on(self, unwrapped: Any, batch: dict[str, torch.Tensor], config: GenerationConfig,
                     **options: Any) -> torch.Tensor:
        """Completion ids of ``batch`` sampled by a model from ``_generation_model`` (``options`` go to
        ``generate``)."""
        gen_inputs = dict(batch)
        if self.pass_token_types:
            gen_inputs["mm_token_type_ids"] = token_types(batch["input_ids"], self.model.config)
        with generation_config_of(unwrapped, config):
            if self.shared_prefix:
                return sample_shared_prefix(unwrapped, gen_inputs, config)
            return unwrapped.generate(**gen_inputs, generation_config=config,
                                      **options)[:, batch["input_ids"].shape[1]:]

    def _generate(self, model: Any, batch: dict[str, torch.Tensor], config: GenerationConfig) -> torch.Tensor:
        with self._generation_model(model) as unwrapped:
            return self._generate_on(unwrapped, batch, config)

    def _sample(self, model: Any, batch: dict[str, torch.Tensor], meta: list[SampleMeta], greedy: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(completion ids, the sampler's log-probs or None): HF ``generate`` or the vLLM engine."""
        if self.vllm is None:
            return self._generate(model, batch, self.greedy_config if greedy else self.generation_config), None
        if self.run_state.vllm_step != self.state.global_step:
            self._sync_weights(model)
            self.run_state.vllm_step = self.state.global_step
        prompts = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
        out = self.vllm.generate(prompts, [m.images or [] for m in meta], [m.index for m in meta],
                                 self.tokenizer.pad_token_id, greedy=greedy, videos=[m.videos or [] for m in meta])
        device = batch["input_ids"].device
        return out.ids.to(device), out.logps.to(device)

    def _sync_weights(self, model: Any) -> None:
        """Push the current weights into the engine; logs the sync's seconds and, on CUDA, the memory it added at its
        peak above what was allocated before it (``vllm/sync_added_gib``: one block beyond the shards under
        ZeRO-3)."""
        cuda = torch.cuda.is_available()
        if cuda:
            self.run_state.cuda_peak = max(self.run_state.cuda_peak, torch.cuda.max_memory_allocated())
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        self.vllm.load_weights(self.accelerator.unwrap_model(model), zero3=self._zero3())
        self.run_state.metrics["vllm/sync_seconds"].append(time.perf_counter() - start)
        if cuda:
            self.run_state.metrics["vllm/sync_added_gib"].append((torch.cuda.max_memory_allocated() - before) / 2**30)

    def _zero3(self) -> bool:
        plugin = self.accelerator.state.deepspeed_plugin
        return plugin is not None and plugin.zero_stage == 3

    def _completions(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str], int]:
        """(ids, attention mask, stopped, texts, rows cut): cut at the stop token and before any vision placeholder
        (suppressed in sampling; this is the safety net if one appears anyway). A cut row did not stop."""
        mask, stopped = completion_mask(ids, self.stop_token_ids)
        ids, mask, cut = cut_at_tokens(ids, mask, self.suppressed, self.tokenizer.pad_token_id)
        lengths = mask.sum(dim=1).tolist()
        texts = [decode_kept(self.tokenizer, row[:n], self.drop_ids) for row, n in zip(ids.tolist(), lengths)]
        return ids, mask, stopped & ~cut, texts, int(cut.sum())

    def _forward_inputs(self, batch: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor
                        ) -> dict[str, Any]:
        """Prompt + completion inputs of the training passes: one packed row per prompt with its images once
        (shared prefix), or each prompt and its images repeated for every completion."""
        G = self.num_generations
        visual = [(pixels, grid) for pixels, grid in VISUAL if pixels in batch]
        if self.shared_prefix:
            inputs, layout = shared_prefix.pack_group(batch["input_ids"], batch["attention_mask"], ids, mask, G)
            inputs[shared_prefix.KWARG] = layout
            for pixels, grid in visual:
                inputs[pixels], inputs[grid] = batch[pixels], batch[grid]
            if "second_per_grid_ts" in batch:
                inputs["second_per_grid_ts"] = batch["second_per_grid_ts"]
        else:
            inputs = {
                "input_ids": torch.cat([batch["input_ids"].repeat_interleave(G, 0), ids], dim=1),
                "attention_mask": torch.cat([batch["attention_mask"].repeat_interleave(G, 0), mask], dim=1),
            }
            for pixels, grid in visual:
                per_sample = self._per_sample(batch, grid)
                inputs[pixels], inputs[grid] = repeat_visual(batch[pixels], batch[grid], per_sample, G)
                if pixels == "pixel_values_videos" and "second_per_grid_ts" in batch:
                    inputs["second_per_grid_ts"] = batch["second_per_grid_ts"].new_tensor(
                        repeat_values(batch["second_per_grid_ts"], per_sample, G))
        if self.pass_token_types:
            inputs["mm_token_type_ids"] = token_types(inputs["input_ids"], self.model.config)
        return inputs

    def _reward_results(self, texts: list[str], meta: list[SampleMeta], lengths: list[int]) -> list[Scored]:
        """Each reward's values for ``texts`` (G per prompt of ``meta``), failures included."""
        columns, shared = reward_inputs(meta, self.num_generations, self.resize_policy, self.coords, lengths,
                                        self.max_new_tokens, self.grpo_args.grpo_overlong_buffer)
        return [score(reward, texts, columns, shared) for reward in self.reward_funcs]

    def _score(self, texts: list[str], meta: list[SampleMeta], lengths: list[int],
               results: list[Scored] | None = None) -> torch.Tensor:
        """The weighted total reward of each completion, with each reward's metrics logged; ``results``: already
        computed (dynamic sampling scores each part as it is sampled)."""
        results = results if results is not None else self._reward_results(texts, meta, lengths)
        self._report_reward_failures(results)
        for reward, scored in zip(self.reward_funcs, results):
            clean = torch.tensor(scored.values)
            self.run_state.metrics[f"rewards/{reward.name}/mean"].append(float(clean.mean()))
            self.run_state.metrics[f"rewards/{reward.name}/std"].append(float(clean.std()) if len(clean) > 1 else 0.0)
            self.run_state.metrics[f"rewards/{reward.name}/errors"].append(float(sum(scored.errors)))
        return self._weighted_total(results, len(texts))

    def _weighted_total(self, results: list[Scored], count: int) -> torch.Tensor:
        """Each of ``count`` completions' total reward: the rewards' values times their ``reward_weights``."""
        total = torch.zeros(count)
        for reward, scored in zip(self.reward_funcs, results):
            total += reward.weight * torch.tensor(scored.values)
        return total

    def _report_reward_failures(self, results: list[Scored]) -> None:
        """Each reward's first failure is logged with its traceback; a reward that fails on every completion of a
        rollout (on any rank: every rank stops together) stops the run unless ``grpo_stop_on_reward_failure:
        false``: its signal is gone, and training would go on blind."""
        here = [bool(r.errors) and all(r.errors) for r in results]
        anywhere = here
        if self.accelerator.num_processes > 1:
            flags = torch.tensor(here, dtype=torch.int, device=self.accelerator.device)
            anywhere = (self.accelerator.reduce(flags, reduction="sum") > 0).tolist()
        for reward, scored, mine, stop in zip(self.reward_funcs, results, here, anywhere):
            if stop and self.grpo_args.grpo_stop_on_reward_failure:
                where = scored.failure if mine else "on another rank"
                raise RuntimeError(f"reward {reward.name!r} failed on every completion of this rollout, {where}\n"
                                   "Fix the reward (or set grpo_stop_on_reward_failure: false to score such "
                                   "completions 0 and go on).")
            if scored.failure is not None and reward.name not in self.run_state.reported_rewards:
                self.run_state.reported_rewards.add(reward.name)
                logger.warning(f"reward {reward.name!r} failed on {sum(scored.errors)} of {len(scored.errors)} "
                               f"completions (they score 0, counted in rewards/{reward.name}/errors; shown once), "
                               f"{scored.failure}")

    def _with_blanks(self, features: list[dict[str, Any]], part: int) -> list[dict[str, Any]]:
        """``features`` plus, for each prompt with images (and no videos: ``blankable``) drawn with probability
        ``grpo_blank_image_ratio``, a copy whose images are blank (``blank_like``). The draw is seeded by (seed,
        rank, micro-step, part), so a resumed run draws the same prompts."""
        ratio = self.grpo_args.grpo_blank_image_ratio
        if ratio <= 0:
            return features
        rank_key = self.args.seed * 1_000_003 + self.args.process_index
        seed = (rank_key * 1_000_003 + self.run_state.micro_step) * 97 + part
        draws = torch.rand(len(features), generator=torch.Generator().manual_seed(seed)).tolist()
        blanks = [blank_copy(feature) for feature, draw in zip(features, draws) if blankable(feature) and draw < ratio]
        return features + blanks

    def _check_blank_frame(self, batch: dict[str, torch.Tensor], meta: list[SampleMeta]) -> None:
        """A blank copy must have exactly its original's image grid: same resize, same image tokens."""
        if not any(m.blank for m in meta):
            return
        per_sample = images_per_sample(batch["input_ids"], self.vision_start_id, self.image_id)
        grids = dict(zip(range(len(meta)), batch["image_grid_thw"].split(per_sample)))
        originals = {m.index: grids[i] for i, m in enumerate(meta) if not m.blank}
        for i, m in enumerate(meta):
            if m.blank and not torch.equal(grids[i], originals[m.index]):
                raise RuntimeError(f"the blank copy of dataset record {m.index} has image grid "
                                   f"{grids[i].tolist()}, the image {originals[m.index].tolist()}: it would not be "
                                   "the same frame; please report this")

    def _blank_rewards(self, texts: list[str], meta: list[SampleMeta]) -> torch.Tensor:
        """-penalty for a confident answer on a blank image (``confident_answer``), 0 for an abstention."""
        G, penalty = self.num_generations, self.grpo_args.grpo_blank_image_penalty
        confident = [confident_answer(text, meta[i // G].reference) for i, text in enumerate(texts)]
        if texts:
            self.run_state.metrics["blank/confident_rate"].append(sum(confident) / len(confident))
        return torch.tensor([-penalty if c else 0.0 for c in confident], dtype=torch.float32)

    def _sample_part(self, model: Any, features: list[dict[str, Any]]) -> SampledPart:
        """One micro-batch's prompts collated, sampled G times each and cut into completions."""
        batch, meta = self._collate(features)
        if "image_grid_thw" in batch:
            self._check_blank_frame(batch, meta)
        sampled, sampling_logps = self._sample(model, batch, meta)
        ids, attention, stopped, texts, cut = self._completions(sampled)
        self.run_state.metrics["vision_tokens_cut"].append(float(cut))
        return SampledPart(features, batch, meta, texts, ids, attention, stopped, sampling_logps)

    def _finish_part(self, model: Any, part: SampledPart) -> None:
        """The training inputs of a sampled micro-batch, and its old and reference log-probs where needed."""
        inputs = self._forward_inputs(part.batch, part.ids, part.attention)
        with torch.no_grad(), self._shared_attention():
            old = self._token_logps(model, inputs, part.ids)[0] if self.off_policy else None
            ref = self._reference_logps(model, inputs, part.ids) if self.grpo_args.grpo_beta != 0 else None
        part.finish(inputs, old, ref)

    def _rollout(self, model: Any, features: list[dict[str, Any]]) -> list[MicroBatch]:
        if self.agent is not None:
            return self._agent_rollout(model, features)
        G, spg = self.num_generations, self.steps_per_generation
        per_micro = len(features) // spg
        model.train()
        parts, scored = [], None
        for j in range(spg):
            parts.append(self._sample_part(model, self._with_blanks(features[j * per_micro:(j + 1) * per_micro], j)))
            if not self.grpo_args.grpo_dynamic_sampling:  # sample, then the log-probs, part by part (the RNG's order)
                self._finish_part(model, parts[-1])
        if self.grpo_args.grpo_dynamic_sampling:
            parts, scored = self._refill(model, parts, per_micro)
            for part in parts:
                self._finish_part(model, part)
        meta = [m for part in parts for m in part.meta]
        texts = [t for part in parts for t in part.texts]
        device = parts[0].ids.device
        blank = torch.tensor([m.blank for m in meta for _ in range(G)], device=device)
        real_meta = [m for m in meta if not m.blank]
        real_texts = [t for t, b in zip(texts, blank.tolist()) if not b]
        lengths = torch.cat([part.attention.sum(dim=1) for part in parts]).float()  # widths differ per part
        rewards = self._score(real_texts, real_meta, [int(n) for n in lengths[~blank].tolist()], scored).to(device)
        adv = torch.zeros(len(texts), device=device)
        adv[~blank] = self._advantages(rewards, lengths[~blank])
        every_reward = adv.clone()
        every_reward[~blank] = rewards
        if blank.any():  # baseline 0, not group-relative: a model that answers every blank image gets a signal
            adv[blank] = every_reward[blank] = self._blank_rewards(
                [t for t, b in zip(texts, blank.tolist()) if b], [m for m in meta if m.blank]).to(device)
        keep = torch.ones(len(texts), dtype=torch.bool, device=device)
        if self.grpo_args.grpo_skip_zero_std_groups:
            flat = zero_std_groups(rewards, G)
            keep[~blank] &= ~flat
            self.run_state.metrics["groups_skipped"].append(float(flat.sum()) / G)
        stopped = torch.cat([part.stopped for part in parts])
        if self.grpo_args.grpo_mask_truncated:
            keep &= stopped
        bounds = torch.tensor([0] + [len(part.meta) * G for part in parts]).cumsum(0).tolist()
        masks = [part.attention * keep[bounds[j]:bounds[j + 1]].unsqueeze(1).long() for j, part in enumerate(parts)]
        counts = micro_batch_counts(masks).to(device)
        counts = self.accelerator.reduce(counts, reduction="sum") if self.accelerator.num_processes > 1 else counts
        norms = step_normalizers(counts, self.grad_accum, self.accelerator.num_processes).tolist()
        stats = rollout_metrics(rewards, lengths[~blank], stopped[~blank], real_texts, real_meta, G)
        add_monitors(self.run_state.monitors, self.run_state.span_monitors, real_texts, real_meta, G, self.coords,
                     self.run_state.click_monitors)
        for key, value in stats.items():
            self.run_state.metrics[key].append(value)
        self._warn_if_flat(stats, real_texts, real_meta)
        if self.grpo_args.grpo_log_completions:
            self._log_completions(texts, every_reward.tolist(), meta)
        return [MicroBatch(inputs=part.inputs, completion_ids=part.ids, mask=masks[j],
                           advantages=adv[bounds[j]:bounds[j + 1]], old_logps=part.old_logps, ref_logps=part.ref_logps,
                           token_normalizer=norms[j][0], seq_normalizer=norms[j][1], sampling_logps=part.sampling_logps)
                for j, part in enumerate(parts)]

    def _advantages(self, rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The advantages of ``grpo_advantage_estimator`` (the estimator registry); its batch statistics (``batch``
        scale, REINFORCE++'s whitening) are over the global batch, every rank's completions."""
        return estimator(self.grpo_args.grpo_advantage_estimator).advantages(
            rewards, lengths, self.num_generations, self.grpo_args.grpo_scale_rewards, self._ranks)

    def _warn_if_flat(self, stats: dict[str, float], texts: list[str], meta: list[SampleMeta]) -> None:
        """Say so when GRPO cannot learn: in every group all completions got the same reward, so every advantage
        (and the policy loss) is 0, for ``FLAT_PATIENCE`` rollouts in a row. Once per streak. (Plain REINFORCE++ has
        no group baseline: its advantages differ between groups, so it is not told: ``Estimator.group_baseline``.)"""
        flat = bool(texts) and stats["frac_reward_zero_std"] == 1.0
        flat = flat and estimator(self.grpo_args.grpo_advantage_estimator).group_baseline
        self.run_state.flat_rollouts = self.run_state.flat_rollouts + 1 if flat else 0
        if self.run_state.flat_rollouts != FLAT_PATIENCE:
            return
        grounded = sum(bool(try_parse_items(m.reference)) for m in meta) * self.num_generations
        failures = f"{stats['parse_failures']:.0f} of {grounded} completions did not parse as boxes; " if grounded \
            else ""
        logger.warning(
            f"GRPO is not learning: for {FLAT_PATIENCE} rollouts in a row every group's completions got the same "
            f"reward (last: mean {stats['reward']:.3g}), so every advantage is 0. {failures}"
            f"{stats['truncated_ratio']:.0%} hit max_new_tokens. A completion: {texts[0][:300]!r}. Likely causes: "
            "the model cannot produce the answer format yet (train SFT longer, check the template), max_new_tokens "
            "cuts the answers, the rewards do not tell these completions apart, or temperature is too low.")
