"""Rollout throughput, hf ``generate`` vs the vLLM engine, on the same prompts and images, in one run.

Run in the vLLM environment (``scripts/vllm_env.sh .venv-vllm``)::

    .venv-vllm/bin/python benchmarks/bench_rollout.py [--prompts 8] [--generations 8] [--new-tokens 32]

Both sample G completions per prompt at temperature 1 with no truncation, the vision tokens suppressed, from the
same random-weight tiny Qwen2.5-VL, each prompt with one image in the pinned frame. Completions per second, and
the ratio vllm / hf. One warm-up round each is not timed. On a GPU use ``bench_grpo_gpu.py`` instead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from llamafactory_qwenvl_patch.grpo.sampling import vision_token_ids
from llamafactory_qwenvl_patch.grpo.vllm_engine import VLLMEngine, VLLMSettings
from llamafactory_qwenvl_patch.images import model_input_image
from llamafactory_qwenvl_patch.policy import ResizePolicy
from qwenvl_prep.tiny_model import build_tiny_model

POLICY = ResizePolicy(64 * 28 * 28, 256 * 28 * 28, 28)
SIZES = [(640, 480), (1920, 1080), (333, 777), (1024, 768)]


def prompts(tokenizer, count: int) -> list[tuple[list[int], Image.Image]]:
    out = []
    for i in range(count):
        w, h = SIZES[i % len(SIZES)]
        image = model_input_image(Image.new("RGB", (w, h), (40 * i % 255, 90, 160)), POLICY)
        pads = image.width * image.height // 28 // 28
        ids = tokenizer.encode("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * pads
                               + f"<|vision_end|>Locate object {i}.<|im_end|>\n<|im_start|>assistant\n")
        out.append((ids, image))
    return out


def hf_rollout(model, processor, batch, generations: int, new_tokens: int, stop: int, banned: list[int]) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=generations,
                              max_new_tokens=new_tokens, eos_token_id=[stop], pad_token_id=stop,
                              suppress_tokens=banned)
    done = 0
    for ids, image in batch:  # one prompt per generate call, as a micro-batch of 1 in GRPO
        visual = processor.image_processor(images=[image], return_tensors="pt", min_pixels=POLICY.min_pixels,
                                           max_pixels=POLICY.max_pixels)
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 pixel_values=visual["pixel_values"], image_grid_thw=visual["image_grid_thw"],
                                 generation_config=config)
        done += out.shape[0]
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "tiny")
        tokenizer = AutoTokenizer.from_pretrained(path)
        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        banned = vision_token_ids(tokenizer)
        sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                    "max_new_tokens": args.new_tokens}
        engine = VLLMEngine(str(path), POLICY, VLLMSettings(max_model_len=2048, max_num_seqs=256, dtype="float32"),
                            sampling, [stop], banned, args.generations, model.config.image_token_id)
        batch = prompts(tokenizer, args.prompts)
        results = {}
        for name, run in (
            ("hf", lambda: hf_rollout(model, processor, batch, args.generations, args.new_tokens, stop, banned)),
            ("vllm", lambda: engine.generate([ids for ids, _ in batch], [[image] for _, image in batch],
                                             list(range(len(batch))), tokenizer.pad_token_id).ids.shape[0]),
        ):
            run()  # warm-up
            start = time.perf_counter()
            done = run()
            seconds = time.perf_counter() - start
            results[name] = {"completions": done, "seconds": round(seconds, 3),
                             "completions_per_s": round(done / seconds, 2)}
        results["vllm_over_hf"] = round(results["vllm"]["completions_per_s"] / results["hf"]["completions_per_s"], 2)
        results["settings"] = vars(args) | {"device": "cpu", "torch_threads": torch.get_num_threads()}
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
