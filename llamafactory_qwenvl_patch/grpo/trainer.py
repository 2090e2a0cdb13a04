"""GRPOTrainer: a transformers Trainer, so DeepSpeed, checkpointing, resume, logging and LF's callbacks keep working.

Each training step takes a batch of prompts (with their images), samples G completions per prompt, scores them with
the reward functions, and optimises the clipped group-relative policy-gradient loss (plus an optional KL term).
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, Trainer

from llamafactory_qwenvl_patch.answers import AnswerError, parse_items
from llamafactory_qwenvl_patch.grpo.loss import advantages, policy_loss
from llamafactory_qwenvl_patch.grpo.rewards import RewardFunc
from llamafactory_qwenvl_patch.images import open_image
from llamafactory_qwenvl_patch.policy import ResizePolicy

GENERATION_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")
COUNTERS = ("errors", "parse_failures")


@dataclass
class SampleMeta:
    """What rewards need about one prompt, captured before LF's collator turns paths into tensors."""

    index: int
    prompt: str
    reference: str
    orig_hw: tuple[int, int] | None


class GRPOCollator:
    """Wraps LF's multimodal collator: keeps the reference answer, original image size and dataset index."""

    def __init__(self, collator: Any, tokenizer: Any) -> None:
        self.collator = collator
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        meta, stripped = [], []
        for feature in features:
            feature = dict(feature)
            index = int(feature.pop("grpo_index"))
            labels = [t for t in feature.get("labels") or [] if t >= 0]
            images = feature.get("images") or []
            orig_hw = None
            if images:
                with open_image(images[0]) as image:
                    orig_hw = (image.height, image.width)
            prompt = self.tokenizer.decode(feature["input_ids"], skip_special_tokens=True)
            meta.append(SampleMeta(index, prompt, self.tokenizer.decode(labels, skip_special_tokens=True), orig_hw))
            stripped.append(feature)
        batch = self.collator(stripped)
        batch["grpo_meta"] = meta
        return batch


def _unparsed(text: str) -> bool:
    """True when a text yields no boxes or points (malformed or absent)."""
    try:
        return not parse_items(text)
    except AnswerError:
        return True


def _images_per_sample(input_ids: torch.Tensor, vision_start_id: int, image_id: int) -> list[int]:
    starts = input_ids[:, :-1] == vision_start_id
    return (starts & (input_ids[:, 1:] == image_id)).sum(dim=1).tolist()


def _repeat_visual(pixel_values: torch.Tensor, grid: torch.Tensor, per_sample: list[int], times: int):
    """Repeat each sample's image patches ``times`` times, in sample order (matches ``repeat_interleave``)."""
    patches = grid.prod(dim=1).tolist()
    pixel_chunks, grid_chunks, p, g = [], [], 0, 0
    for count in per_sample:
        n_patches = int(sum(patches[g:g + count]))
        for _ in range(times):
            pixel_chunks.append(pixel_values[p:p + n_patches])
            grid_chunks.append(grid[g:g + count])
        p, g = p + n_patches, g + count
    return torch.cat(pixel_chunks), torch.cat(grid_chunks)


class GRPOTrainer(Trainer):
    def __init__(self, *, finetuning_args: Any, generating_args: Any, reward_funcs: list[tuple[str, RewardFunc, float]],
                 ref_model: Any, policy: ResizePolicy | None, coords: str, stop_token_ids: list[int],
                 processor: Any, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(processing_class=processor or tokenizer, **kwargs)
        self.model_accepts_loss_kwargs = False  # the loss is a per-step mean: let Trainer scale for accumulation
        self.fa = finetuning_args
        self.tokenizer = tokenizer
        self.reward_funcs = reward_funcs
        self.policy = policy
        self.coords = coords
        self.num_generations = finetuning_args.grpo_num_generations
        gen = generating_args.to_dict(obey_generation_config=True)
        if not gen.get("temperature"):
            raise ValueError("stage: grpo samples completions: set temperature > 0")
        gen.update(do_sample=True, num_return_sequences=self.num_generations, eos_token_id=stop_token_ids,
                   pad_token_id=tokenizer.pad_token_id, use_cache=True)
        self.generation_config = GenerationConfig(**gen)
        self.max_new_tokens = self.generation_config.max_new_tokens
        self.temperature = float(self.generation_config.temperature)
        self.stop_token_ids = stop_token_ids
        config = self.model.config
        self.vision_start_id = config.vision_start_token_id
        self.image_id = config.image_token_id
        self.video_id = getattr(config, "video_token_id", None)
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        # transformers 5.x Qwen3-VL needs the token types to place M-RoPE positions; LF's collator does not emit them.
        self.pass_token_types = "mm_token_type_ids" in inspect.signature(type(base).forward).parameters
        self.patch = int(getattr(getattr(config, "vision_config", None), "patch_size", 14))
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self.ref_model = ref_model
        if ref_model is not None:
            if self.is_deepspeed_enabled:
                from trl.models import prepare_deepspeed

                self.ref_model = prepare_deepspeed(ref_model, self.accelerator)
            else:
                self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)

    # --- one step ------------------------------------------------------------------------------------------------

    def _generate(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        from trl.models import unwrap_model_for_generation

        gen_inputs = {k: inputs[k] for k in GENERATION_KEYS if k in inputs}
        if self.pass_token_types:
            gen_inputs["mm_token_type_ids"] = self._token_types(inputs["input_ids"])
        with torch.no_grad(), unwrap_model_for_generation(
            model, self.accelerator, gather_deepspeed3_params=True
        ) as unwrapped:
            was_training = unwrapped.training
            unwrapped.eval()
            try:
                out = unwrapped.generate(**gen_inputs, generation_config=self.generation_config)
            finally:
                unwrapped.train(was_training)
        return out[:, inputs["input_ids"].shape[1]:]

    def _token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """0 for text, 1 for image tokens, 2 for video tokens (what the HF processor returns)."""
        types = torch.zeros_like(input_ids)
        types[input_ids == self.image_id] = 1
        if self.video_id is not None:
            types[input_ids == self.video_id] = 2
        return types

    def _completion_mask(self, completion_ids: torch.Tensor) -> torch.Tensor:
        is_stop = torch.isin(completion_ids, torch.tensor(self.stop_token_ids, device=completion_ids.device))
        length = completion_ids.size(1)
        no_stop = torch.full_like(is_stop[:, 0], length, dtype=torch.long)
        first_stop = torch.where(is_stop.any(dim=1), is_stop.int().argmax(dim=1), no_stop)
        positions = torch.arange(length, device=completion_ids.device).unsqueeze(0)
        return (positions <= first_stop.unsqueeze(1)).long()

    def _token_logps(self, model: Any, batch: dict[str, torch.Tensor], completion_ids: torch.Tensor) -> torch.Tensor:
        length = completion_ids.size(1)
        logits = model(**batch, logits_to_keep=length + 1, use_cache=False).logits[:, :-1, :]
        # Row by row in float32: a full-vocabulary log_softmax of every completion at once costs G x T x V floats.
        rows = []
        for row_logits, row_ids in zip(logits, completion_ids):
            row_logits = row_logits.float() / self.temperature
            chosen = torch.gather(row_logits, 1, row_ids.unsqueeze(-1)).squeeze(-1)
            rows.append(chosen - torch.logsumexp(row_logits, dim=-1))
        return torch.stack(rows)

    def _score(self, texts: list[str], meta: list[SampleMeta], model_hws: list[tuple[int, int] | None]) -> torch.Tensor:
        G = self.num_generations
        per_completion = dict(
            references=[m.reference for m in meta for _ in range(G)],
            orig_sizes=[m.orig_hw for m in meta for _ in range(G)],
            model_sizes=[hw for hw in model_hws for _ in range(G)],
            indices=[m.index for m in meta for _ in range(G)],
            policy=self.policy,
            coords=self.coords,
        )
        total = torch.zeros(len(texts))
        for name, func, weight in self.reward_funcs:
            try:
                values = [float(v) for v in func(texts, **per_completion)]
                if len(values) != len(texts):
                    raise ValueError(f"returned {len(values)} rewards for {len(texts)} completions")
                errors = [not math.isfinite(v) for v in values]
            except Exception:  # noqa: BLE001 - a user reward must never stop training
                values, errors = [0.0] * len(texts), [True] * len(texts)
            clean = torch.tensor([0.0 if bad else v for v, bad in zip(values, errors)])
            self._metrics[f"rewards/{name}/mean"].append(float(clean.mean()))
            self._metrics[f"rewards/{name}/std"].append(float(clean.std()) if len(clean) > 1 else 0.0)
            self._metrics[f"rewards/{name}/errors"].append(float(sum(errors)))
            total += weight * clean
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        meta: list[SampleMeta] = inputs.pop("grpo_meta")
        G = self.num_generations
        if "pixel_values_videos" in inputs:
            raise ValueError("stage: grpo supports still images and text; this batch has videos")
        completion_ids = self._generate(model, inputs)
        completion_mask = self._completion_mask(completion_ids)
        texts = self.tokenizer.batch_decode(completion_ids * completion_mask + self.tokenizer.pad_token_id
                                            * (1 - completion_mask), skip_special_tokens=True)
        batch = {
            "input_ids": torch.cat([inputs["input_ids"].repeat_interleave(G, 0), completion_ids], dim=1),
            "attention_mask": torch.cat([inputs["attention_mask"].repeat_interleave(G, 0), completion_mask], dim=1),
        }
        if self.pass_token_types:
            batch["mm_token_type_ids"] = self._token_types(batch["input_ids"])
        model_hws: list[tuple[int, int] | None] = [None] * len(meta)
        if "pixel_values" in inputs:
            per_sample = _images_per_sample(inputs["input_ids"], self.vision_start_id, self.image_id)
            batch["pixel_values"], batch["image_grid_thw"] = _repeat_visual(
                inputs["pixel_values"], inputs["image_grid_thw"], per_sample, G)
            first, grid = 0, inputs["image_grid_thw"].tolist()
            for i, count in enumerate(per_sample):
                if count:
                    model_hws[i] = (grid[first][1] * self.patch, grid[first][2] * self.patch)
                first += count
        rewards = self._score(texts, meta, model_hws).to(completion_ids.device)
        batch_std = None
        if self.fa.grpo_scale_rewards == "batch" and self.accelerator.num_processes > 1:
            batch_std = float(self.accelerator.gather(rewards).std())
        adv = advantages(rewards, G, self.fa.grpo_scale_rewards, batch_std=batch_std)
        logps = self._token_logps(model, batch, completion_ids)
        ref_logps = None
        if self.fa.grpo_beta != 0:
            with torch.no_grad():
                if self.ref_model is not None:
                    ref_logps = self._token_logps(self.ref_model, batch, completion_ids)
                else:
                    unwrapped = self.accelerator.unwrap_model(model)
                    with unwrapped.disable_adapter() if hasattr(unwrapped, "disable_adapter") else nullcontext():
                        ref_logps = self._token_logps(model, batch, completion_ids)
        total_tokens = None
        if self.fa.grpo_loss_type == "dapo":
            count = completion_mask.sum().float().reshape(1)
            total_tokens = float(self.accelerator.gather(count).sum()) / self.accelerator.num_processes
        parts = policy_loss(logps, logps.detach(), ref_logps, adv, completion_mask, self.fa.grpo_beta,
                            self.fa.grpo_epsilon, self.fa.grpo_epsilon_high, self.fa.grpo_loss_type,
                            self.max_new_tokens, total_tokens)
        self._record(rewards, completion_mask, parts, texts, meta)
        return parts.loss

    # --- metrics -------------------------------------------------------------------------------------------------

    def _record(self, rewards, completion_mask, parts, texts, meta) -> None:
        G = self.num_generations
        lengths = completion_mask.sum(dim=1).float()
        grouped = rewards.view(-1, G)
        m = self._metrics
        m["reward"].append(float(rewards.mean()))
        m["reward_std"].append(float(rewards.std()) if rewards.numel() > 1 else 0.0)
        m["frac_reward_zero_std"].append(float((grouped.std(dim=1) < 1e-6).float().mean()))
        m["kl"].append(parts.kl)
        m["clip_ratio"].append(parts.clip_ratio)
        m["completion_length/mean"].append(float(lengths.mean()))
        m["completion_length/max"].append(float(lengths.max()))
        grounded = [not _unparsed(sample.reference) for sample in meta]  # once per prompt, not per completion
        m["parse_failures"].append(float(sum(_unparsed(text) for i, text in enumerate(texts) if grounded[i // G])))
        if self.fa.grpo_log_completions:
            self._log_completions(texts, rewards.tolist(), meta)

    def _log_completions(self, texts: list[str], rewards: list[float], meta: list[SampleMeta]) -> None:
        from accelerate.utils import gather_object

        G = self.num_generations
        rows = [{"step": self.state.global_step, "index": meta[i // G].index, "prompt": meta[i // G].prompt,
                 "reference": meta[i // G].reference, "completion": text, "reward": reward}
                for i, (text, reward) in enumerate(zip(texts, rewards))]
        rows = gather_object(rows)
        if self.accelerator.is_main_process:
            os.makedirs(self.args.output_dir, exist_ok=True)
            with open(os.path.join(self.args.output_dir, "completions.jsonl"), "a", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add the step's GRPO metrics: means averaged over ranks, error and parse-failure counts summed."""
        if "loss" in logs and self._metrics:
            for reduction, names in (("mean", [n for n in sorted(self._metrics) if not n.endswith(COUNTERS)]),
                                     ("sum", [n for n in sorted(self._metrics) if n.endswith(COUNTERS)])):
                if not names:
                    continue
                agg = sum if reduction == "sum" else (lambda v: sum(v) / len(v))
                local = torch.tensor([float(agg(self._metrics[n])) for n in names], device=self.accelerator.device)
                if self.accelerator.num_processes > 1:
                    local = self.accelerator.reduce(local, reduction=reduction)
                logs.update({name: round(value, 6) for name, value in zip(names, local.tolist())})
            self._metrics.clear()
        super().log(logs, *args, **kwargs)
