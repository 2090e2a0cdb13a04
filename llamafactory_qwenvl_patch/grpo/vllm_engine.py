"""GRPO rollouts on vLLM, colocated in the training process (trl's ``colocate`` mode), in the training frame.

vLLM runs its own HF processor on the images it is given. Handed the original image it would resize with the
checkpoint's bounds, and the rollout would see another image than the loss. So it receives the exact model-input
image (``qwen_vl_utils.fetch_image`` under the run's pinned policy) and the same bounds as ``mm_processor_kwargs``
(its resize is then the identity), and every batch is checked: the image tokens vLLM put in each prompt must equal
the training batch's, or the run stops.

Log-probs for the loss still come from the training model; vLLM's sampling log-probs (``processed_logprobs``:
after temperature and the suppressed vision tokens) feed the optional truncated importance-sampling correction and
the logged mismatch.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy


class FrameMismatchError(RuntimeError):
    """vLLM's prompt holds another number of image tokens than the training batch: another frame."""


@dataclass(frozen=True)
class VLLMSettings:
    gpu_memory_utilization: float = 0.4
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 64
    seed: int = 0
    dtype: str = "auto"  # the training model's dtype, so the sampler computes what the loss computes
    prefix_caching: bool | None = None  # None: on where it works (see VLLMEngine)


@dataclass
class Rollout:
    """G completions per prompt: padded ids (stop token kept, pad after it) and the sampler's log-probs (0 on pads)."""

    ids: torch.Tensor  # (N * G, T)
    logps: torch.Tensor  # (N * G, T)


def collapse_image_pads(ids: list[int], image_id: int) -> list[int]:
    """Each image's run of ``<|image_pad|>`` as one token: vLLM expands it again with its own count."""
    return [t for i, t in enumerate(ids) if not (t == image_id and i > 0 and ids[i - 1] == image_id)]


def image_token_counts(ids: list[int], image_id: int) -> list[int]:
    """The length of each run of image tokens, in order."""
    counts, run = [], 0
    for t in [*ids, None]:
        if t == image_id:
            run += 1
        elif run:
            counts.append(run)
            run = 0
    return counts


def vllm_weight_name(name: str, peft_prefix: str = "lora_") -> str | None:
    """The checkpoint name vLLM's ``load_weights`` takes for a (peft-wrapped) training parameter; None for adapter
    weights (merged into the base weights before the sync) and peft's saved copies of original modules."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if peft_prefix in name or "original_module" in name:
        return None
    return name.replace("modules_to_save.default.", "")


def engine_weights(model: Any) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor of the model as it samples: a peft model's active LoRA deltas added to the base
    weights they adapt (the model itself is not modified)."""
    peft = hasattr(model, "peft_config")
    prefix = getattr(model, "prefix", "lora_")
    weights = {}
    for name, param in model.named_parameters():
        target = vllm_weight_name(name, prefix) if peft else name
        if target is not None:
            weights[target] = param.data
    if peft:
        from peft.tuners.lora import LoraLayer

        for module_name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or module.merged:
                continue
            target = vllm_weight_name(f"{module_name}.base_layer.weight", prefix)
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            if target in weights and torch.is_tensor(delta):
                weights[target] = weights[target] + delta.to(weights[target].dtype)
    return weights


class VLLMEngine:
    """One vLLM ``LLM`` per training process, fed the current weights before each rollout."""

    def __init__(self, model_path: str, policy: ResizePolicy, settings: VLLMSettings, sampling: dict[str, Any],
                 stop_token_ids: list[int], suppress_token_ids: list[int], num_generations: int,
                 image_token_id: int) -> None:
        if settings.tensor_parallel_size != 1:
            raise ValueError("grpo_vllm_tensor_parallel_size > 1 is not supported yet: each training rank runs its own "
                             "engine (tensor parallel 1)")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights by reference
        from vllm import LLM

        cpu = not torch.cuda.is_available()
        self.llm = LLM(
            model=model_path, tensor_parallel_size=1, gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs, seed=settings.seed,
            dtype=settings.dtype,
            mm_processor_kwargs={"min_pixels": policy.min_pixels, "max_pixels": policy.max_pixels},
            limit_mm_per_prompt={"image": 8, "video": 0}, logprobs_mode="processed_logprobs",
            enable_prefix_caching=not cpu if settings.prefix_caching is None else settings.prefix_caching,
            max_num_batched_tokens=4096, enforce_eager=cpu,
        )
        self.policy = policy
        self.image_token_id = image_token_id
        self.stop_token_ids = stop_token_ids
        self.sampling = sampling
        self.suppress = suppress_token_ids
        self.num_generations = num_generations

    def _params(self, greedy: bool) -> Any:
        from vllm import SamplingParams

        common = dict(max_tokens=self.sampling["max_new_tokens"], stop_token_ids=self.stop_token_ids, logprobs=0,
                      logit_bias={t: -100.0 for t in self.suppress} or None)
        if greedy:
            return SamplingParams(n=1, temperature=0.0, **common)
        top_k = self.sampling["top_k"]
        return SamplingParams(n=self.num_generations, temperature=self.sampling["temperature"],
                              top_p=self.sampling["top_p"], top_k=top_k if top_k and top_k > 0 else -1,
                              repetition_penalty=self.sampling["repetition_penalty"], **common)

    def generate(self, prompts: list[list[int]], images: list[list[Any]], indices: list[int], pad_id: int,
                 greedy: bool = False) -> Rollout:
        """Sample for unpadded prompts whose images are already model-input images; check the frame per prompt."""
        requests = []
        for ids, pictures in zip(prompts, images):
            request: dict[str, Any] = {"prompt_token_ids": collapse_image_pads(ids, self.image_token_id)}
            if pictures:
                request["multi_modal_data"] = {"image": pictures}
            requests.append(request)
        outputs = self.llm.generate(requests, sampling_params=self._params(greedy), use_tqdm=False)
        for ids, output, index in zip(prompts, outputs, indices):
            mine = image_token_counts(ids, self.image_token_id)
            theirs = image_token_counts(list(output.prompt_token_ids or []), self.image_token_id)
            if mine != theirs:
                raise FrameMismatchError(
                    f"dataset record {index}: vLLM's prompt has image tokens {theirs}, the training batch {mine}: "
                    f"the rollout would see another image than the loss (bounds {self.policy.min_pixels}-"
                    f"{self.policy.max_pixels}); check that vLLM's processor honours mm_processor_kwargs")
        rows, logps = [], []
        for output in outputs:
            for completion in output.outputs:
                tokens = list(completion.token_ids)
                values = [_chosen_logprob(step, token) for step, token in zip(completion.logprobs or [], tokens)]
                if completion.finish_reason == "stop" and (not tokens or tokens[-1] not in self.stop_token_ids):
                    tokens.append(self.stop_token_ids[0])  # a stop token vLLM left out of the ids
                    values.append(0.0)
                rows.append(tokens)
                logps.append(values + [0.0] * (len(tokens) - len(values)))
        width = max(1, max(map(len, rows)))
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
        lp = torch.tensor([v + [0.0] * (width - len(v)) for v in logps], dtype=torch.float32)
        return Rollout(ids, lp)

    def load_weights(self, model: Any, zero3: bool = False) -> None:
        """Push the training weights into the engine. LoRA: each adapted weight is sent as base + delta, computed
        out of place (merging into the base and unmerging after, as trl does, leaves rounding noise in the frozen
        base weights at every sync). ZeRO-3: parameters gathered first."""
        gather = nullcontext
        if zero3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters
        engine_model = self._engine_model()
        with torch.no_grad(), gather(list(model.parameters())):
            engine_model.load_weights(list(engine_weights(model).items()))
        self.llm.reset_prefix_cache()

    def _engine_model(self) -> Any:
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        worker = getattr(worker, "worker", worker)  # a WorkerWrapperBase around the worker
        return worker.model_runner.model


def _chosen_logprob(step: Any, token: int) -> float:
    entry = step.get(token) if isinstance(step, dict) else None
    return float(entry.logprob) if entry is not None else 0.0
