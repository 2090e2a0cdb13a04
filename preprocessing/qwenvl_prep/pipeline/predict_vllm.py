"""``qwenvl-prep predict --backend vllm``: offline vLLM (``LLM``) in the model folder's recorded frame.

vLLM runs its own HF processor, so, as for GRPO rollouts, it gets the exact model-input image (the folder's policy,
``model_input_image``) and the same bounds as ``mm_processor_kwargs``, which makes its resize the identity; every
answer's prompt is checked to hold the frame's image-token count. Same chat template, greedy or sampled at the
temperature (top-k and top-p off, per-request seeds from ``--seed`` and the batch), float32 on CPU as the HF
backend; the tokens are decoded by the same processor call and become the same rows (boxes mapped to original
pixels by ``FolderModel._row``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.grpo.vllm_engine import (
    CPU_KV_CACHE_GIB, engine_dtypes, image_token_counts, name_text_architectures,
)
from llamafactory_qwenvl_patch.image_io.images import model_input_image
from qwenvl_prep.formats.prompt_presets import PromptPreset
from qwenvl_prep.pipeline.predict import FolderModel


class VLLMPredictor(FolderModel):
    """One vLLM engine over a merged model folder (an adapter folder is refused with the command that merges it)."""

    def __init__(self, model_dir: str | Path, max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                 tensor_parallel_size: int = 1, preset: PromptPreset | None = None) -> None:
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
        cpu = not torch.cuda.is_available()
        if cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        config = self.processor.tokenizer  # the image token's id, as the processor writes it
        self.image_token_id = config.convert_tokens_to_ids("<|image_pad|>")
        self.llm = LLM(
            model=str(model_dir), tensor_parallel_size=tensor_parallel_size, seed=seed,
            **engine_dtypes(str(model_dir), "float32" if cpu else "auto", cpu),
            mm_processor_kwargs={"min_pixels": self.policy.min_pixels, "max_pixels": self.policy.max_pixels},
            limit_mm_per_prompt={"image": 1, "video": 0}, enforce_eager=cpu, hf_overrides=name_text_architectures,
        )
        self._batch = 0

    def seed_batch(self, index: int) -> None:
        self._batch = index

    def batch(self, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Answer several (image, prompt) pairs in one ``generate``; each prompt's image tokens are checked against
        the folder's frame."""
        from PIL import Image
        from vllm import SamplingParams

        requests, sizes = [], []
        for image_path, prompt in jobs:
            image = model_input_image(image_path, self.policy)
            with Image.open(image_path) as original:
                sizes.append(((original.height, original.width), (image.height, image.width)))
            requests.append({"prompt": self.prompt_text(prompt, (image.height, image.width)),
                             "multi_modal_data": {"image": image}})
        params = [SamplingParams(temperature=self.temperature, top_k=-1, top_p=1.0, max_tokens=self.max_new_tokens,
                                 detokenize=False, seed=(self._generator_seed * 1_000_003 + self._batch) * 4_099 + position
                                 if self.temperature > 0 else None)
                  for position in range(len(requests))]
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
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
        raise ValueError("--backend vllm answers images; predict videos with --backend hf (the default), which "
                         "samples and clocks them by the folder's video policy")
