"""GRPO step time and peak GPU memory of a 7B-shaped Qwen2.5-VL, hf rollouts vs vLLM rollouts, in one run.

For a GPU machine with the vLLM environment (``scripts/vllm_env.sh .venv-vllm --gpu``); no model hub needed: the
checkpoint is Qwen2.5-VL-7B's architecture with random weights, built from its config::

    .venv-vllm/bin/python benchmarks/bench_grpo_gpu.py OUT [--steps 4] [--generations 8] [--new-tokens 256]

Both runs are ``llamafactory-cli train`` with ``stage: grpo``, LoRA, bf16, the same data, seed and keys, differing
only in ``grpo_rollout_backend``. Reported per backend: seconds per optimiser step (after the first) and the peak
``torch.cuda.max_memory_allocated`` that the trainer logs as ``memory/max_allocated_gib``; and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

SEVEN_B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
                    rope_scaling={"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]},
                    tie_word_embeddings=False)
SEVEN_B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14)


def build_checkpoint(out: Path) -> Path:
    """Qwen2.5-VL-7B's shapes with random bf16 weights, the tiny builder's tokenizer and processor."""
    import torch
    import transformers

    from qwenvl_prep.tiny_model import QWEN_SPECIAL_TOKENS, build_tokenizer

    tokenizer = build_tokenizer()
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    text = dict(SEVEN_B_TEXT, vocab_size=152064, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=SEVEN_B_VISION, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out)
    processor = transformers.Qwen2_5_VLProcessor(image_processor=transformers.Qwen2VLImageProcessor(),
                                                 tokenizer=tokenizer, video_processor=transformers.Qwen2VLVideoProcessor())
    processor.save_pretrained(out)
    return out


def write_data(folder: Path, count: int = 64) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(count):
        w, h = [(1920, 1080), (1024, 768), (640, 480), (3024, 4032)][i % 4]
        Image.new("RGB", (w, h), (30 * i % 255, 120, 200)).save(folder / f"img{i}.jpg")
        records.append({"messages": [{"role": "user", "content": "<image>Locate the object; answer bbox_2d JSON."},
                                     {"role": "assistant", "content": '[{"bbox_2d": [10, 20, 300, 400]}]'}],
                        "images": [f"img{i}.jpg"]})
    (folder / "bench.json").write_text(json.dumps(records))
    (folder / "dataset_info.json").write_text(json.dumps({"bench": {
        "file_name": "bench.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))


def run(out: Path, model: Path, backend: str, args: argparse.Namespace) -> dict:
    config = {
        "model_name_or_path": str(model), "template": "qwen2_vl", "qwenvl_patch": True,
        "image_min_pixels": 256 * 28 * 28, "image_max_pixels": 1280 * 28 * 28, "stage": "grpo", "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "dataset": "bench", "dataset_dir": str(out / "data"),
        "cutoff_len": 4096, "output_dir": str(out / backend), "logging_steps": 1, "save_strategy": "no",
        "max_steps": args.steps, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "bf16": True,
        "learning_rate": 1e-5, "report_to": "none", "reward_funcs": "iou,format", "grpo_num_generations":
        args.generations, "max_new_tokens": args.new_tokens, "temperature": 1.0, "grpo_rollout_backend": backend,
        "grpo_vllm_gpu_memory_utilization": 0.35, "gradient_checkpointing": True, "seed": 0,
    }
    path = out / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = Path(sys.executable).parent / "llamafactory-cli"
    subprocess.run([str(cli), "train", str(path)], check=True, env={**os.environ, "DISABLE_VERSION_CHECK": "1"})
    rows = [json.loads(line) for line in (out / backend / "trainer_log.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]

    def seconds(row: dict) -> float:
        h, m, s = (int(v) for v in row["elapsed_time"].split(":"))
        return h * 3600 + m * 60 + s

    per_step = (seconds(steps[-1]) - seconds(steps[0])) / max(len(steps) - 1, 1)
    return {"seconds_per_step": round(per_step, 1),
            "peak_gib": max(row.get("memory/max_allocated_gib", 0.0) for row in steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "qwen2_5_vl_7b_random"
    if not (model / "config.json").exists():
        build_checkpoint(model)
    write_data(args.out / "data")
    results = {backend: run(args.out, model, backend, args) for backend in ("hf", "vllm")}
    results["step_time_vllm_over_hf"] = round(results["vllm"]["seconds_per_step"] / results["hf"]["seconds_per_step"], 3)
    results["peak_memory_vllm_over_hf"] = round(results["vllm"]["peak_gib"] / max(results["hf"]["peak_gib"], 1e-9), 3)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
