"""Records per second of ``qwenvl-prep predict`` with the transformers backend against the vLLM backend, on the same
model folder and images, in one run::

    .venv/bin/python benchmarks/bench_predict.py [--model DIR] [--images 48] [--batch-size 8] [--json-out F]

Without ``--model`` it builds a random-weight ``--size small`` model of ``--family`` (vLLM's CPU attention needs its
heads); on a GPU machine pass a real exported folder (and ``--tensor-parallel-size``). Each backend runs as a user
runs it (a subprocess, greedy, the same batch size and ``--max-new-tokens``) twice: on one image and on all of them,
so that the model and engine load (the first run's time) is taken out: records per second is
``(images - 1) / (T_all - T_one)``. Images are of mixed sizes under the folder's frame. Answers of a random model run
to ``--max-new-tokens``, as long answers do.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record

SIZES = [(640, 480), (1920, 1080), (333, 777), (1024, 768), (300, 300), (800, 200), (1280, 720), (500, 1500)]


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a merged model folder (default: build a small random one)")
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    prep = str(Path(sys.executable).parent / "qwenvl-prep")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            from qwenvl_prep.demos.tiny_model import build_tiny_model

            model = build_tiny_model(root / "model", args.family, size="small")
            factor = FAMILIES[args.family].factor
            write_policy_record(model, ResizePolicy(64 * factor * factor, 256 * factor * factor, factor))
        images = []
        for k in range(args.images):
            width, height = SIZES[k % len(SIZES)]
            path = root / f"i{k}.jpg"
            Image.new("RGB", (width, height), (30 + 7 * k % 200, 90, 160)).save(path)
            images.append(str(path))
        results = {}
        for backend in ("hf", "vllm"):
            def run(paths: list[str], name: str) -> float:
                return timed([prep, "predict", str(model), *paths, "--prompt", "Locate every object, output its "
                              "bbox coordinates using JSON format.", "--backend", backend, "--batch-size",
                              str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens),
                              "--tensor-parallel-size", str(args.tensor_parallel_size), "-o",
                              str(root / f"{backend}-{name}.jsonl")])

            one, everything = run(images[:1], "one"), run(images, "all")
            results[backend] = {"one_image_s": round(one, 2), "all_images_s": round(everything, 2),
                                "records_per_s": round((len(images) - 1) / max(everything - one, 1e-9), 3)}
        results["vllm_over_hf"] = round(results["vllm"]["records_per_s"] / results["hf"]["records_per_s"], 2)
        results["setup"] = {"model": str(args.model or f"random {args.family} --size small"), "images": args.images,
                            "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens}
    print(json.dumps(results, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
