"""``qwenvl-prep predict --backend vllm``: offline vLLM (``LLM``) in the model folder's recorded frame.

vLLM runs its own HF processor, so, as for GRPO rollouts, it gets the exact model-input image (the folder's policy,
``model_input_image``) and the same bounds as ``mm_processor_kwargs``, which makes its resize the identity; every
answer's prompt is checked to hold the frame's image-token count. Same chat template, greedy or sampled at the
temperature (top-k and top-p off, per-request seeds from ``--seed`` and the batch), float32 on CPU as the HF
backend; the tokens are decoded by the same processor call and become the same rows (boxes mapped to original
pixels by ``FolderModel._row``).

Videos of every family get the frames the HF backend reads, with each plan's clock as metadata, as GRPO's vLLM
rollouts do: each prompt vLLM builds is checked token for token against the HF processor's, and on Qwen2.5-VL's
clock each video's seconds per group against the plan's. vLLM places the text after a video where the HF backend's
pinned model does (``frame.mrope``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.video import video_processor_kwargs
from llamafactory_qwenvl_patch.grpo.generation.vllm_engine import (
    CPU_KV_CACHE_GIB,
    engine_dtypes,
    image_token_counts,
    name_text_architectures,
)
from llamafactory_qwenvl_patch.grpo.generation.vllm_video import vllm_video_grids
from llamafactory_qwenvl_patch.grpo.generation.weight_sync import vllm_version
from llamafactory_qwenvl_patch.image_io.images import model_input_image
from llamafactory_qwenvl_patch.model_files.folder import CONFIG, FileEdit, ModelFolder, NotPortableError
from llamafactory_qwenvl_patch.model_files.readers import reader_problems, vllm_reader
from qwenvl_prep.formats.prompt_presets import PromptPreset
from qwenvl_prep.pipeline.predict import ClipBatch, FolderModel


class VLLMPredictor(FolderModel):
    """One vLLM engine over a merged model folder (an adapter folder is refused with the command that merges it)."""

    def __init__(self, model_dir: str | Path, max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                 tensor_parallel_size: int = 1, preset: PromptPreset | None = None, images_per_prompt: int = 1
                 ) -> None:
        super().__init__(model_dir, max_new_tokens, temperature, seed, preset)
        if self.base is not None:
            raise ValueError(f"{model_dir} is a LoRA adapter: vLLM needs the merged model. Merge it with "
                             f"`llamafactory-cli export` (adapter_name_or_path: {model_dir}, export_dir: ...) under "
                             "qwenvl_patch: true, or predict with --backend hf, which merges it in memory")
        try:
            import torch
            from vllm import LLM
        except ImportError:
            raise ValueError("--backend vllm needs vLLM in this environment (scripts/add_vllm.sh); --backend hf "
                             "does not") from None
        problems = engine_problems(Path(model_dir))
        if problems:
            raise ValueError(f"{model_dir} would stop vLLM once its engine started:\n  " + "\n  ".join(problems)
                             + f"\n`qwenvl-prep fix-config {model_dir} --target vllm` repairs what is named by file "
                             "and key (backups kept); export the model again for the rest")
        cpu = not torch.cuda.is_available()
        if cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        config = self.processor.tokenizer  # the image token's id, as the processor writes it
        self.image_token_id = config.convert_tokens_to_ids("<|image_pad|>")
        self.llm = LLM(
            model=str(model_dir), tensor_parallel_size=tensor_parallel_size, seed=seed,
            **engine_dtypes(str(model_dir), "float32" if cpu else "auto", cpu),
            mm_processor_kwargs={"min_pixels": self.policy.min_pixels, "max_pixels": self.policy.max_pixels},
            limit_mm_per_prompt={"image": images_per_prompt, "video": 1},  # an agent's prompt: one screenshot a turn
            mm_processor_cache_gb=0,  # the clip check reads each grid
            enforce_eager=cpu, hf_overrides=name_text_architectures,
        )
        self._batch = 0

    def seed_batch(self, index: int) -> None:
        self._batch = index

    def _params(self, count: int, call: int = 0) -> list[Any]:
        """Greedy, or sampled at the temperature with a seed per request from ``--seed``, the batch, the call within
        the batch (an agent's turn) and its place."""
        from vllm import SamplingParams

        batch_seed = ((self._generator_seed * 1_000_003 + self._batch) * 4_099 + call) * 65_537
        return [SamplingParams(temperature=self.temperature, top_k=-1, top_p=1.0, max_tokens=self.max_new_tokens,
                               detokenize=False, seed=batch_seed + position if self.temperature > 0 else None)
                for position in range(count)]

    def screens(self, texts: list[str], screenshots: list[list[Any]], call: int = 0) -> list[str]:
        """Answer chat-template prompts ``texts``, each with its screenshots (model-input images, already in the
        folder's frame: vLLM's resize is the identity), in one ``generate``; every prompt is checked to hold each
        screenshot's image-token count."""
        requests = [{"prompt": text, "multi_modal_data": {"image": list(images)}}
                    for text, images in zip(texts, screenshots)]
        outputs = self.llm.generate(requests, sampling_params=self._params(len(requests), call), use_tqdm=False)
        for k, (output, images) in enumerate(zip(outputs, screenshots)):
            expected = [self.policy.image_tokens(image.height, image.width) for image in images]
            found = image_token_counts(list(output.prompt_token_ids or []), self.image_token_id)
            if found != expected:
                raise RuntimeError(f"vLLM's prompt {k} holds image tokens {found}, its screenshots in the folder's "
                                   f"frame need {expected}: vLLM resized a screenshot again")
        return self.decode([list(output.outputs[0].token_ids) for output in outputs])

    def batch(self, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Answer several (image, prompt) pairs in one ``generate``; each prompt's image tokens are checked against
        the folder's frame."""
        from PIL import Image

        requests, sizes = [], []
        for image_path, prompt in jobs:
            image = model_input_image(image_path, self.policy)
            with Image.open(image_path) as original:
                sizes.append(((original.height, original.width), (image.height, image.width)))
            requests.append({"prompt": self.prompt_text(prompt, (image.height, image.width)),
                             "multi_modal_data": {"image": image}})
        outputs = self.llm.generate(requests, sampling_params=self._params(len(requests)), use_tqdm=False)
        # decoded as the HF backend decodes (vLLM's incremental detokenizer holds back an unfinished UTF-8 sequence)
        answers = self.decode([list(output.outputs[0].token_ids) for output in outputs])
        rows = []
        for (image_path, prompt), output, answer, (orig_hw, model_hw) in zip(jobs, outputs, answers, sizes):
            expected = self.policy.image_tokens(*orig_hw)
            found = image_token_counts(list(output.prompt_token_ids or []), self.image_token_id)
            if found != [expected]:
                raise RuntimeError(f"vLLM's prompt for {image_path} holds image tokens {found}, the folder's frame "
                                   f"{model_hw[1]}x{model_hw[0]} needs [{expected}]: vLLM resized the image again "
                                   "(its processor did not take the bounds)")
            rows.append(self._row(image_path, prompt, answer, orig_hw, model_hw))
        return rows

    def video_batch(self, jobs: list[tuple[str, str]], frame_list_fps: float | None = None) -> list[dict[str, Any]]:
        """Answer several (clip, prompt) pairs in one ``generate``: vLLM gets each clip's frames as the HF backend
        reads them (the folder's video frame), with the plan's clock as metadata and no resampling or resize; every
        prompt vLLM built is checked, token for token (stamps and pads), against the HF processor's."""
        import numpy as np

        batch = self.read_clips(jobs, frame_list_fps)
        requests = [{"prompt": text, "mm_processor_kwargs": video_processor_kwargs([plan]),
                     "multi_modal_data": {"video": plan.vllm_item(np.stack([np.asarray(frame) for frame in frames]))}}
                    for text, frames, plan in zip(batch.texts, batch.frames, batch.plans)]
        with vllm_video_grids(self.llm, vllm_version()) as encoded:
            outputs = self.llm.generate(requests, sampling_params=self._params(len(requests)), use_tqdm=False)
        for k, ((video, _), output, [theirs]) in enumerate(zip(jobs, outputs, encoded)):
            one = ClipBatch(batch.texts[k:k + 1], batch.frames[k:k + 1], batch.plans[k:k + 1], batch.sizes[k:k + 1])
            if list(output.prompt_token_ids or []) != self.processor_inputs(one)["input_ids"][0].tolist():
                raise RuntimeError(f"vLLM's prompt for {video} differs from the HF processor's (its frame groups, "
                                   "pads or time stamps): vLLM resized or resampled the clip")
            plan = batch.plans[k]
            if plan.clock == "seconds" and theirs.second_per_grid_ts != plan.second_per_grid_ts:
                raise RuntimeError(f"vLLM put {video}'s frame groups {theirs.second_per_grid_ts} s apart, the folder's "
                                   f"clock {plan.second_per_grid_ts} s: its positions would not be the HF backend's")
        return self.video_rows(jobs, self.decode([list(o.outputs[0].token_ids) for o in outputs]), batch)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")  # what vLLM's load_format "auto" looks for


def engine_problems(model_dir: Path) -> list[str]:
    """What the installed vLLM would stop on in the folder only after its engine started (a minute on CPU, more on
    GPUs): the reader rules of ``model_files.readers`` for the folder as the engine gets it (its text config named
    as ``name_text_architectures`` names it), and weights to load. The chat template is ``FolderModel``'s check."""
    try:
        folder = ModelFolder.load(model_dir)
    except NotPortableError as exc:
        return [str(exc)]
    config = folder.get(CONFIG) or {}
    text = config.get("text_config")
    if isinstance(text, dict) and not text.get("architectures"):
        named = {**text, "architectures": list(config.get("architectures") or [])}
        folder = folder.with_edits([FileEdit(CONFIG, {**config, "text_config": named})])
    problems = reader_problems(folder, vllm_reader(None), chat=False)
    if not any(next(model_dir.glob(pattern), None) for pattern in WEIGHT_FILES):
        problems.append(f"{model_dir}: no weights ({', '.join(WEIGHT_FILES)}), which vLLM loads at start-up")
    return problems

