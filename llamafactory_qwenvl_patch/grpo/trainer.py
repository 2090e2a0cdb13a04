"""GRPOTrainer: a transformers Trainer, so DeepSpeed, checkpointing, resume, logging and LF's callbacks keep working.

Rollout and optimisation are two steps, as in trl, verl and EasyR1. Every ``grpo_steps_per_generation`` x
``grpo_num_iterations`` micro-steps a rollout takes the rank's generation batch (``per_device_train_batch_size`` x
``grpo_steps_per_generation`` prompts), samples G completions per prompt, scores them, computes advantages, the old
and reference log-probs and the step normalisers, and stores one ``MicroBatch`` per micro-step; each micro-step then
optimises its stored micro-batch with the clipped surrogate. With ``grpo_num_iterations > 1`` the same rollout is
optimised again and the ratio to the old log-probs (and clipping) acts.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from contextlib import nullcontext
from functools import partial
from typing import Any, ContextManager

import torch
from torch.utils.data import DataLoader
from transformers import GenerationConfig, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker

from llamafactory_qwenvl_patch.frame.mrope import needs_token_types, token_types
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.grpo import resume, shared_prefix
from llamafactory_qwenvl_patch.grpo.collate import blank_copy
from llamafactory_qwenvl_patch.grpo.evaluation import eval_metrics
from llamafactory_qwenvl_patch.grpo.gather_budget import zero3_budget
from llamafactory_qwenvl_patch.grpo.loss import (
    advantages, micro_batch_counts, policy_loss, step_normalizers, zero_std_groups,
)
from llamafactory_qwenvl_patch.grpo.prefix_sampling import sample_shared_prefix
from llamafactory_qwenvl_patch.grpo.reference import reference_context, saving_trained_adapter_only
from llamafactory_qwenvl_patch.grpo.rewards import Reward, Scored, confident_answer, reward_inputs, score
from llamafactory_qwenvl_patch.grpo.rollout import (
    MicroBatch, SampleMeta, completion_mask, cut_at_tokens, decode_kept, first_image_sizes, images_per_sample,
    add_monitors, repeat_visual, rollout_metrics,
)
from llamafactory_qwenvl_patch.grpo.sampler import RolloutSampler
from llamafactory_qwenvl_patch.grpo.sampling import generation_config_of
from llamafactory_qwenvl_patch.image_io.images import model_input_image
from llamafactory_qwenvl_patch.scoring.answers import try_parse_items
from llamafactory_qwenvl_patch.scoring.detection import MonitorTally

GENERATION_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")
COUNTERS = ("errors", "parse_failures", "vision_tokens_cut", "groups_skipped")
FLAT_PATIENCE = 3  # rollouts in a row whose every group scored alike before the run warns that it learns nothing
COMPLETIONS = "completions.jsonl"
logger = logging.getLogger("llamafactory.qwenvl_patch.grpo")


class _SamplerEpoch(TrainerCallback):
    """Give the rollout sampler the epoch number. Trainer's ``set_epoch`` on the dataloader does not reach it after a
    resume (accelerate's skip wrapper stops two levels short), and a resumed epoch must replay the same order."""

    def __init__(self, trainer: "GRPOTrainer") -> None:
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.trainer.rollout_sampler is not None:
            self.trainer.rollout_sampler.set_epoch(int(state.epoch + 1e-6) if state.epoch else 0)


class _Resumable(TrainerCallback):
    """A relaunch continues the same run: rows logged after the checkpoint it resumes from are dropped from
    completions.jsonl, and each checkpoint gets its complete-marker last (after the processor and every rank's
    files), so a checkpoint a kill cuts short is never resumed from (``resume``)."""

    def __init__(self, trainer: "GRPOTrainer") -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if args.should_save:
            step = state.global_step
            resume.trim_jsonl(os.path.join(args.output_dir, COMPLETIONS), lambda row: row.get("step", 0) < step)

    def on_save(self, args, state, control, **kwargs):
        self.trainer.accelerator.wait_for_everyone()
        if args.should_save:
            resume.mark_complete(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"),
                                 state.global_step)


def _require_trainer_hooks() -> None:
    """The Trainer methods a resumed run relies on (``_save_checkpoint`` and ``_load_rng_state`` are overridden);
    if transformers renamed them, resuming would silently sample a new rollout."""
    import transformers

    missing = [name for name in ("_save_checkpoint", "_load_rng_state") if not callable(getattr(Trainer, name, None))]
    if missing:
        raise RuntimeError(f"transformers {transformers.__version__} has no Trainer.{', Trainer.'.join(missing)}, "
                           "which stage: grpo overrides to resume a run as the same run; install the tested set "
                           "(pip install -c constraints.txt)")


class GRPOTrainer(Trainer):
    def __init__(self, *, finetuning_args: Any, sampling: dict[str, Any], reward_funcs: list[Reward],
                 ref_model: Any, resize_policy: ResizePolicy | None, coords: str, stop_token_ids: list[int],
                 suppress_token_ids: list[int], processor: Any, tokenizer: Any, vllm_engine: Any = None,
                 **kwargs: Any) -> None:
        _require_trainer_hooks()
        super().__init__(processing_class=processor or tokenizer, **kwargs)
        self.model_accepts_loss_kwargs = False  # Trainer divides each micro-batch loss by the accumulation steps
        self.fa = finetuning_args
        self.tokenizer = tokenizer
        self.reward_funcs = reward_funcs
        self.resize_policy = resize_policy
        self.coords = coords
        self.num_generations = finetuning_args.grpo_num_generations
        self.grad_accum = self.args.gradient_accumulation_steps
        self.steps_per_generation = finetuning_args.grpo_steps_per_generation or self.grad_accum
        if self.steps_per_generation % self.grad_accum:
            raise ValueError(f"grpo_steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                             f"gradient_accumulation_steps ({self.grad_accum}): a rollout covers whole optimiser steps")
        self.num_iterations = finetuning_args.grpo_num_iterations
        self.off_policy = self.num_iterations > 1 or self.steps_per_generation > self.grad_accum
        self.stop_token_ids = stop_token_ids
        self.suppressed = suppress_token_ids
        self.drop_ids = {*stop_token_ids, tokenizer.pad_token_id}
        common = dict(eos_token_id=stop_token_ids, pad_token_id=tokenizer.pad_token_id, use_cache=True,
                      suppress_tokens=suppress_token_ids or None)
        self.generation_config = GenerationConfig(do_sample=True, num_return_sequences=self.num_generations,
                                                  **sampling, **common)
        self.greedy_config = GenerationConfig(do_sample=False, num_return_sequences=1,
                                              max_new_tokens=sampling["max_new_tokens"], **common)
        self.max_new_tokens = self.generation_config.max_new_tokens
        self.temperature = float(self.generation_config.temperature)
        config = self.model.config
        self.vision_start_id = config.vision_start_token_id
        self.image_id = config.image_token_id
        self.pass_token_types = needs_token_types(self.model)  # M-RoPE positions in transformers 5.x
        image_processor = getattr(processor, "image_processor", None)
        # what turns an image grid into pixels: the pinned policy, else the processor's own (same factor)
        self.grid_frame = resize_policy or (ResizePolicy.from_processor(image_processor) if image_processor else None)
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._monitors = MonitorTally()  # detection-hack counts since the last log
        self._buffer: list[MicroBatch] | None = None
        self._micro_step = 0
        self._reported_rewards: set[str] = set()
        self._flat_rollouts = 0  # rollouts in a row in which every group's rewards were all equal
        self.rollout_sampler: RolloutSampler | None = None
        self.vllm = vllm_engine
        self._vllm_step = -1  # the global step whose weights the engine holds
        self._cuda_peak = 0  # the CUDA peak before the last weight sync reset it
        self._gather_checked = False  # HF rollouts under ZeRO-3: the whole-model gather checked against the GPU
        self._first_pass = True
        self.add_callback(_SamplerEpoch(self))
        self.add_callback(_Resumable(self))  # last: its marker follows every other callback's checkpoint files
        if self.args.load_best_model_at_end and self.args.metric_for_best_model in (None, "loss", "eval_loss"):
            raise ValueError("stage: grpo logs no eval_loss; with load_best_model_at_end set metric_for_best_model "
                             "to a GRPO eval metric, e.g. `metric_for_best_model: eval_reward` and "
                             "`greater_is_better: true`")
        dropout = [m.p for m in self.model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        if dropout:
            logging.getLogger("llamafactory.qwenvl_patch.grpo").warning(
                f"{len(dropout)} dropout layers (p up to {max(dropout)}) are active in training: completions are "
                "sampled without dropout but their log-probs are taken with it, so the on-policy ratio is not 1 "
                "and clipping acts on noise. Set lora_dropout: 0 (LF's default) unless you mean it.")
        self.ref_model = ref_model
        self.shared_prefix = shared_prefix.resolve(finetuning_args.grpo_shared_prefix, self._attention_models())
        if self.shared_prefix:
            for m in self._attention_models():
                shared_prefix.install(m)
        if ref_model is not None:
            if self.is_deepspeed_enabled:
                from trl.models import prepare_deepspeed

                self.ref_model = prepare_deepspeed(ref_model, self.accelerator)
            else:
                self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)

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
        batch, meta = self.data_collator.collate(features, self.drop_ids)
        if self.vllm is not None:  # the exact images the loss sees, for vLLM
            for sample, feature in zip(meta, features):
                sample.images = [model_input_image(src, self.resize_policy) for src in feature.get("images") or []]
        if "pixel_values_videos" in batch:
            raise ValueError("stage: grpo supports still images and text; this batch has videos")
        batch = self._prepare_input({k: v for k, v in batch.items() if k in GENERATION_KEYS})
        if "pixel_values" in batch:
            per_sample = images_per_sample(batch["input_ids"], self.vision_start_id, self.image_id)
            for sample, hw in zip(meta, first_image_sizes(batch["image_grid_thw"], per_sample, self.grid_frame)):
                sample.model_hw = hw
        return batch, meta

    # --- rollout -------------------------------------------------------------------------------------------------

    def _check_gather_budget(self, model: Any) -> None:
        """Once, before the first HF rollout under ZeRO-3 on a GPU: can every rank hold the whole model?"""
        self._gather_checked = True
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

    def _generate(self, model: Any, batch: dict[str, torch.Tensor], config: GenerationConfig) -> torch.Tensor:
        from trl.models import unwrap_model_for_generation

        if not self._gather_checked:
            self._check_gather_budget(model)
        gen_inputs = dict(batch)
        if self.pass_token_types:
            gen_inputs["mm_token_type_ids"] = token_types(batch["input_ids"], self.model.config)
        with torch.no_grad(), unwrap_model_for_generation(
            model, self.accelerator, gather_deepspeed3_params=True
        ) as unwrapped:
            was_training = unwrapped.training
            unwrapped.eval()
            try:
                with generation_config_of(unwrapped, config):
                    if self.shared_prefix:
                        return sample_shared_prefix(unwrapped, gen_inputs, config)
                    return unwrapped.generate(**gen_inputs, generation_config=config)[:, batch["input_ids"].shape[1]:]
            finally:
                unwrapped.train(was_training)

    def _sample(self, model: Any, batch: dict[str, torch.Tensor], meta: list[SampleMeta], greedy: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(completion ids, the sampler's log-probs or None): HF ``generate`` or the vLLM engine."""
        if self.vllm is None:
            return self._generate(model, batch, self.greedy_config if greedy else self.generation_config), None
        if self._vllm_step != self.state.global_step:
            self._sync_weights(model)
            self._vllm_step = self.state.global_step
        prompts = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
        out = self.vllm.generate(prompts, [m.images or [] for m in meta], [m.index for m in meta],
                                 self.tokenizer.pad_token_id, greedy=greedy)
        device = batch["input_ids"].device
        return out.ids.to(device), out.logps.to(device)

    def _sync_weights(self, model: Any) -> None:
        """Push the current weights into the engine; logs the sync's seconds and, on CUDA, the memory it added at its
        peak above what was allocated before it (``vllm/sync_added_gib``: one block beyond the shards under
        ZeRO-3)."""
        cuda = torch.cuda.is_available()
        if cuda:
            self._cuda_peak = max(self._cuda_peak, torch.cuda.max_memory_allocated())
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        self.vllm.load_weights(self.accelerator.unwrap_model(model), zero3=self._zero3())
        self._metrics["vllm/sync_seconds"].append(time.perf_counter() - start)
        if cuda:
            self._metrics["vllm/sync_added_gib"].append((torch.cuda.max_memory_allocated() - before) / 2**30)

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
        has_images = "pixel_values" in batch
        if self.shared_prefix:
            inputs, layout = shared_prefix.pack_group(batch["input_ids"], batch["attention_mask"], ids, mask, G)
            inputs[shared_prefix.KWARG] = layout
            if has_images:
                inputs["pixel_values"], inputs["image_grid_thw"] = batch["pixel_values"], batch["image_grid_thw"]
        else:
            inputs = {
                "input_ids": torch.cat([batch["input_ids"].repeat_interleave(G, 0), ids], dim=1),
                "attention_mask": torch.cat([batch["attention_mask"].repeat_interleave(G, 0), mask], dim=1),
            }
            if has_images:
                per_sample = images_per_sample(batch["input_ids"], self.vision_start_id, self.image_id)
                inputs["pixel_values"], inputs["image_grid_thw"] = repeat_visual(
                    batch["pixel_values"], batch["image_grid_thw"], per_sample, G)
        if self.pass_token_types:
            inputs["mm_token_type_ids"] = token_types(inputs["input_ids"], self.model.config)
        return inputs

    def _token_logps(self, model: Any, inputs: dict[str, Any], completion_ids: torch.Tensor) -> torch.Tensor:
        """Log-probs of the completion tokens under softmax(logits / T) with the vision tokens suppressed, i.e. the
        distribution that was sampled. A shared-prefix forward must run inside ``_shared_attention``."""
        layout = inputs.get(shared_prefix.KWARG)
        keep = completion_ids.size(1) + 1 if layout is None else layout.keep
        logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
        if logits.size(1) == inputs["input_ids"].size(1):  # the model ignores logits_to_keep (4.57's Qwen2-VL)
            logits = logits[:, -keep:] if layout is None else logits[:, keep]
        logits = logits[:, :-1, :] if layout is None else shared_prefix.unpack_logits(logits, layout)
        banned = torch.tensor(self.suppressed, device=logits.device, dtype=torch.long)
        # Row by row in float32: a full-vocabulary log_softmax of every completion at once costs G x T x V floats.
        rows = []
        for row_logits, row_ids in zip(logits, completion_ids):
            row_logits = row_logits.float() / self.temperature
            if len(banned):
                row_logits = row_logits.index_fill(1, banned, float("-inf"))
            chosen = torch.gather(row_logits, 1, row_ids.unsqueeze(-1)).squeeze(-1)
            rows.append(chosen - torch.logsumexp(row_logits, dim=-1))
        return torch.stack(rows)

    def _reference_logps(self, model: Any, inputs: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        if self.ref_model is not None:
            return self._token_logps(self.ref_model, inputs, ids)
        with reference_context(self.accelerator.unwrap_model(model)):
            return self._token_logps(model, inputs, ids)

    def _score(self, texts: list[str], meta: list[SampleMeta]) -> torch.Tensor:
        columns, shared = reward_inputs(meta, self.num_generations, self.resize_policy, self.coords)
        total = torch.zeros(len(texts))
        results = [score(reward, texts, columns, shared) for reward in self.reward_funcs]
        self._report_reward_failures(results)
        for reward, scored in zip(self.reward_funcs, results):
            clean = torch.tensor(scored.values)
            self._metrics[f"rewards/{reward.name}/mean"].append(float(clean.mean()))
            self._metrics[f"rewards/{reward.name}/std"].append(float(clean.std()) if len(clean) > 1 else 0.0)
            self._metrics[f"rewards/{reward.name}/errors"].append(float(sum(scored.errors)))
            total += reward.weight * clean
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
            if stop and self.fa.grpo_stop_on_reward_failure:
                where = scored.failure if mine else "on another rank"
                raise RuntimeError(f"reward {reward.name!r} failed on every completion of this rollout, {where}\n"
                                   "Fix the reward (or set grpo_stop_on_reward_failure: false to score such "
                                   "completions 0 and go on).")
            if scored.failure is not None and reward.name not in self._reported_rewards:
                self._reported_rewards.add(reward.name)
                logger.warning(f"reward {reward.name!r} failed on {sum(scored.errors)} of {len(scored.errors)} "
                               f"completions (they score 0, counted in rewards/{reward.name}/errors; shown once), "
                               f"{scored.failure}")

    def _with_blanks(self, features: list[dict[str, Any]], part: int) -> list[dict[str, Any]]:
        """``features`` plus, for each prompt with images drawn with probability ``grpo_blank_image_ratio``, a copy
        whose images are blank (``blank_like``). The draw is seeded by (seed, rank, micro-step, part), so a resumed
        run draws the same prompts."""
        ratio = self.fa.grpo_blank_image_ratio
        if ratio <= 0:
            return features
        seed = ((self.args.seed * 1_000_003 + self.args.process_index) * 1_000_003 + self._micro_step) * 97 + part
        draws = torch.rand(len(features), generator=torch.Generator().manual_seed(seed)).tolist()
        blanks = [blank_copy(feature) for feature, draw in zip(features, draws)
                  if feature.get("images") and draw < ratio]
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
        G, penalty = self.num_generations, self.fa.grpo_blank_image_penalty
        confident = [confident_answer(text, meta[i // G].reference) for i, text in enumerate(texts)]
        if texts:
            self._metrics["blank/confident_rate"].append(sum(confident) / len(confident))
        return torch.tensor([-penalty if c else 0.0 for c in confident], dtype=torch.float32)

    def _rollout(self, model: Any, features: list[dict[str, Any]]) -> list[MicroBatch]:
        G, spg = self.num_generations, self.steps_per_generation
        per_micro = len(features) // spg
        model.train()
        parts = []
        for j in range(spg):
            batch, meta = self._collate(self._with_blanks(features[j * per_micro:(j + 1) * per_micro], j))
            if "image_grid_thw" in batch:
                self._check_blank_frame(batch, meta)
            sampled, sampling_logps = self._sample(model, batch, meta)
            ids, attention, stopped, texts, cut = self._completions(sampled)
            self._metrics["vision_tokens_cut"].append(float(cut))
            inputs = self._forward_inputs(batch, ids, attention)
            with torch.no_grad(), self._shared_attention():
                old = self._token_logps(model, inputs, ids) if self.off_policy else None
                ref = self._reference_logps(model, inputs, ids) if self.fa.grpo_beta != 0 else None
            parts.append(dict(meta=meta, texts=texts, ids=ids, attention=attention, stopped=stopped, inputs=inputs,
                              old=old, ref=ref, sampling=sampling_logps))
        meta = [m for part in parts for m in part["meta"]]
        texts = [t for part in parts for t in part["texts"]]
        device = parts[0]["ids"].device
        blank = torch.tensor([m.blank for m in meta for _ in range(G)], device=device)
        real_meta = [m for m in meta if not m.blank]
        real_texts = [t for t, b in zip(texts, blank.tolist()) if not b]
        rewards = self._score(real_texts, real_meta).to(device)
        batch_std = None
        if self.fa.grpo_scale_rewards == "batch" and self.accelerator.num_processes > 1:
            batch_std = float(self.accelerator.gather(rewards).std())
        adv = torch.zeros(len(texts), device=device)
        adv[~blank] = advantages(rewards, G, self.fa.grpo_scale_rewards, batch_std=batch_std)
        every_reward = adv.clone()
        every_reward[~blank] = rewards
        if blank.any():  # baseline 0, not group-relative: a model that answers every blank image gets a signal
            adv[blank] = every_reward[blank] = self._blank_rewards(
                [t for t, b in zip(texts, blank.tolist()) if b], [m for m in meta if m.blank]).to(device)
        keep = torch.ones(len(texts), dtype=torch.bool, device=device)
        if self.fa.grpo_skip_zero_std_groups:
            flat = zero_std_groups(rewards, G)
            keep[~blank] &= ~flat
            self._metrics["groups_skipped"].append(float(flat.sum()) / G)
        stopped = torch.cat([part["stopped"] for part in parts])
        if self.fa.grpo_mask_truncated:
            keep &= stopped
        bounds = torch.tensor([0] + [len(part["meta"]) * G for part in parts]).cumsum(0).tolist()
        masks = [part["attention"] * keep[bounds[j]:bounds[j + 1]].unsqueeze(1).long() for j, part in enumerate(parts)]
        counts = micro_batch_counts(masks).to(device)
        counts = self.accelerator.reduce(counts, reduction="sum") if self.accelerator.num_processes > 1 else counts
        norms = step_normalizers(counts, self.grad_accum, self.accelerator.num_processes).tolist()
        lengths = torch.cat([part["attention"].sum(dim=1) for part in parts]).float()  # widths differ per part
        stats = rollout_metrics(rewards, lengths[~blank], stopped[~blank], real_texts, real_meta, G)
        add_monitors(self._monitors, real_texts, real_meta, G, self.coords)
        for key, value in stats.items():
            self._metrics[key].append(value)
        self._warn_if_flat(stats, real_texts, real_meta)
        if self.fa.grpo_log_completions:
            self._log_completions(texts, every_reward.tolist(), meta)
        return [MicroBatch(inputs=part["inputs"], completion_ids=part["ids"], mask=masks[j],
                           advantages=adv[bounds[j]:bounds[j + 1]], old_logps=part["old"], ref_logps=part["ref"],
                           token_normalizer=norms[j][0], seq_normalizer=norms[j][1], sampling_logps=part["sampling"])
                for j, part in enumerate(parts)]

    def _warn_if_flat(self, stats: dict[str, float], texts: list[str], meta: list[SampleMeta]) -> None:
        """Say so when GRPO cannot learn: in every group all completions got the same reward, so every advantage
        (and the policy loss) is 0, for ``FLAT_PATIENCE`` rollouts in a row. Once per streak."""
        flat = bool(texts) and stats["frac_reward_zero_std"] == 1.0
        self._flat_rollouts = self._flat_rollouts + 1 if flat else 0
        if self._flat_rollouts != FLAT_PATIENCE:
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

    # --- optimisation --------------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Roll out on the first micro-step of each round (or after a resume), then optimise the stored slice."""
        round_length = self.steps_per_generation * self.num_iterations
        if self._buffer is None:  # epochs hold whole rounds, so this is the position in the round after a resume
            self._micro_step = 0 if self.args.ignore_data_skip else self.state.global_step * self.grad_accum
        position = self._micro_step % round_length
        if self._buffer is None or position == 0:
            self._buffer = self._rollout(model, inputs["grpo_features"])
        micro = self._buffer[position % self.steps_per_generation]
        self._first_pass = position < self.steps_per_generation
        self._micro_step += 1
        with self._shared_attention():  # the backward too: gradient checkpointing recomputes the forward there
            return super().training_step(model, {"grpo": micro}, num_items_in_batch)

    def _attention_models(self) -> list[Any]:
        """The models whose passes share the prefix: the policy and, when there is one, the separate reference."""
        return [self.model] + ([self.ref_model] if self.ref_model is not None else [])

    def _shared_attention(self) -> ContextManager[None]:
        if not self.shared_prefix:
            return nullcontext()
        return shared_prefix.attention_active(self._attention_models())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        micro: MicroBatch = inputs["grpo"]
        logps = self._token_logps(model, micro.inputs, micro.completion_ids)
        old = micro.old_logps if micro.old_logps is not None else logps.detach()
        weights = self._sampling_weights(old, micro) if micro.sampling_logps is not None else None
        parts = policy_loss(logps, old, micro.ref_logps, micro.advantages, micro.mask, self.fa.grpo_beta,
                            self.fa.grpo_epsilon, self.fa.grpo_epsilon_high, self.fa.grpo_loss_type,
                            self.max_new_tokens, micro.token_normalizer, micro.seq_normalizer,
                            self.fa.grpo_importance_sampling, weights)
        self._metrics["kl"].append(parts.kl)
        self._metrics["clip_ratio"].append(parts.clip_ratio)
        return parts.loss

    def _sampling_weights(self, old: torch.Tensor, micro: MicroBatch) -> torch.Tensor | None:
        """Log how far vLLM's sampling log-probs are from the training model's (first pass over a rollout) and, with
        ``grpo_vllm_is_correction``, the truncated importance weights min(p_train / p_vllm, cap) per token."""
        mask = micro.mask.bool()
        if self._first_pass and mask.any():
            diff = (old - micro.sampling_logps).abs()[mask]
            self._metrics["vllm/logp_diff/mean"].append(float(diff.mean()))
            self._metrics["vllm/logp_diff/max"].append(float(diff.max()))
        if not self.fa.grpo_vllm_is_correction:
            return None
        weights = torch.exp(old - micro.sampling_logps).clamp(max=self.fa.grpo_vllm_is_cap)
        if self._first_pass and mask.any():
            self._metrics["vllm/is_weight/mean"].append(float(weights[mask].mean()))
        return weights

    # --- checkpoints ---------------------------------------------------------------------------------------------

    def _layout(self) -> dict[str, int]:
        return {"steps_per_generation": self.steps_per_generation, "num_iterations": self.num_iterations,
                "gradient_accumulation_steps": self.grad_accum, "world_size": self.accelerator.num_processes}

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint plus this rank's GRPO state: the rollout when the checkpoint falls inside its
        reuse window, the counters and the metrics not logged yet (``resume``)."""
        super()._save_checkpoint(model, trial)
        within_window = self._micro_step % (self.steps_per_generation * self.num_iterations) != 0
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        resume.save_state(folder, self.args.process_index, {
            "layout": self._layout(), "micro_step": self._micro_step,
            "buffer": self._buffer if within_window else None, "metrics": dict(self._metrics),
            "flat_rollouts": self._flat_rollouts, "reported_rewards": sorted(self._reported_rewards)})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Called once when a run resumes, before its first step: restore the GRPO state saved with the checkpoint,
        so a checkpoint inside a reuse window continues with the same rollout."""
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        state = resume.load_state(checkpoint, self.args.process_index, self.accelerator.device)
        round_length = self.steps_per_generation * self.num_iterations
        if state is None or state["layout"] != self._layout():
            if self.off_policy and self.state.global_step * self.grad_accum % round_length:
                logger.warning(f"{checkpoint} lies inside a rollout's reuse window but holds no rollout for this "
                               "layout (written by an older version, or with other grpo_* or world-size settings): "
                               "a new rollout is sampled, so this run will not continue as the interrupted one")
            return
        self._micro_step = state["micro_step"]
        self._buffer = state["buffer"]
        self._metrics = defaultdict(list, state["metrics"])
        self._flat_rollouts = state["flat_rollouts"]
        self._reported_rewards = set(state["reported_rewards"])

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        with saving_trained_adapter_only(self.accelerator.unwrap_model(self.model)):
            super()._save(output_dir, state_dict)

    # --- evaluation ----------------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Greedy answers to the eval prompts: each reward's mean and, for grounding data, Acc@0.5, mean IoU and
        parse failures in original-image pixels (the metrics of ``qwenvl-prep eval``)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        from accelerate.utils import gather_object

        model = self.model_wrapped
        rows = []
        for inputs in self.get_eval_dataloader(dataset):
            features = inputs["grpo_features"]
            if self.fa.grpo_blank_image_ratio > 0:  # every prompt once more on blank images
                features = features + [blank_copy(f) for f in features if f.get("images")]
            batch, meta = self._collate(features)
            texts = self._completions(self._sample(model, batch, meta, greedy=True)[0])[3]
            rows += list(zip(meta, texts))
        # drop even_batches padding: one row per (record, blank or not)
        unique = {(sample.index, sample.blank): (sample, text) for sample, text in gather_object(rows)}
        meta = [sample for sample, _ in unique.values() if not sample.blank]
        texts = [text for sample, text in unique.values() if not sample.blank]
        metrics = eval_metrics(meta, texts, self.reward_funcs, self.resize_policy, self.coords, metric_key_prefix)
        blank = [confident_answer(text, sample.reference) for sample, text in unique.values() if sample.blank]
        if blank:
            metrics[f"{metric_key_prefix}_blank/confident_rate"] = round(sum(blank) / len(blank), 6)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # --- metrics -------------------------------------------------------------------------------------------------

    def _log_completions(self, texts: list[str], rewards: list[float], meta: list[SampleMeta]) -> None:
        from accelerate.utils import gather_object

        G = self.num_generations
        rows = [{"step": self.state.global_step, "index": meta[i // G].index, "prompt": meta[i // G].prompt,
                 "reference": meta[i // G].reference, "completion": text, "reward": reward,
                 "blank": meta[i // G].blank}
                for i, (text, reward) in enumerate(zip(texts, rewards))]
        rows = gather_object(rows)
        if self.accelerator.is_main_process:
            os.makedirs(self.args.output_dir, exist_ok=True)
            with open(os.path.join(self.args.output_dir, COMPLETIONS), "a", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def _reduced_metrics(self) -> dict[str, float]:
        """Every metric collected since the last log over all ranks: counters summed, the rest averaged over every
        value any rank collected. Ranks may hold different names (a rank whose rollouts had no reference boxes has
        no monitors), so the names are gathered first and each rank sends a sum and a count per name."""
        names = sorted(self._metrics)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            names = sorted(set().union(*gather_object([names])))
        values = [self._metrics.get(name, []) for name in names]
        totals = torch.tensor([[float(sum(v)), float(len(v))] for v in values], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        out = {}
        for name, (total, count) in zip(names, totals.tolist()):
            if name.endswith(COUNTERS):
                out[name] = round(total, 6)
            elif count:
                out[name] = round(total / count, 6)
        return out

    def _monitor_metrics(self) -> dict[str, float]:
        """The detection monitors since the last log, from every rank's counts merged (exact rates)."""
        tally, self._monitors = self._monitors, MonitorTally()
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            merged = MonitorTally()
            for part in gather_object([tally]):
                merged.merge(part)
            tally = merged
        return {f"monitor/{key}": round(value, 6) for key, value in tally.to_dict().items() if value is not None}

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add the step's GRPO metrics: means averaged over ranks, error and parse-failure counts summed."""
        if "loss" in logs and torch.cuda.is_available():
            logs["memory/max_allocated_gib"] = round(max(self._cuda_peak, torch.cuda.max_memory_allocated()) / 2**30, 3)
        if "loss" in logs and self._metrics:
            logs.update(self._reduced_metrics())
            logs.update(self._monitor_metrics())
            self._metrics.clear()
        super().log(logs, *args, **kwargs)
