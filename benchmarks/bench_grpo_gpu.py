"""GRPO step time and peak GPU memory of a 7B-shaped Qwen2.5-VL, in one run: the shared prefix (default) against the
repeated layout (``grpo_shared_prefix: false``, our previous code) on hf and on vLLM rollouts, and trl 0.24's
``GRPOTrainer`` (hf rollouts, the prompt repeated G times).

For a GPU machine with vLLM (``scripts/add_vllm.sh .venv --gpu``); no model hub needed: the
checkpoint is Qwen2.5-VL-7B's architecture with random weights, built from its config::

    .venv/bin/python benchmarks/bench_grpo_gpu.py OUT [--steps 4] [--generations 8] [--new-tokens 256]

Ours are ``llamafactory-cli train`` with ``stage: grpo``, LoRA, bf16, gradient checkpointing, sdpa attention, the same
data, seed and keys, differing only in ``grpo_rollout_backend`` and ``grpo_shared_prefix``. Reported per run:
seconds per optimiser step (after the first) and the peak ``torch.cuda.max_memory_allocated`` (logged by the
trainer as ``memory/max_allocated_gib``; for trl read after training); and the ratios to the shared prefix.

``--tensor-parallel 1 2`` (issue 32) runs the vLLM backend alone under ZeRO-3 on as many GPUs as the largest size
(``torchrun``), once per tensor-parallel size, and adds the weight sync's seconds and the memory it adds at its peak
per rank (``vllm/sync_seconds``, ``vllm/sync_added_gib``: one gathered block beyond the shards)::

    .venv/bin/python benchmarks/bench_grpo_gpu.py OUT --tensor-parallel 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from llamafactory_qwenvl_patch.frame.families import FAMILIES, MERGE_SIZE

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEVEN_B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
                    rope_scaling={"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]},
                    tie_word_embeddings=False)
SEVEN_B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      fullatt_block_indexes=[7, 15, 23, 31], window_size=112,
                      patch_size=FAMILIES["qwen2_5_vl"].factor // MERGE_SIZE)


def build_checkpoint(out: Path) -> Path:
    """Qwen2.5-VL-7B's shapes with random bf16 weights, the tiny builder's tokenizer and processor."""
    import torch
    import transformers
    from qwenvl_prep.demos.tiny_model import QWEN_SPECIAL_TOKENS, build_tokenizer

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


def run(out: Path, model: Path, backend: str, shared: bool, args: argparse.Namespace, tp: int | None = None) -> dict:
    config = {
        "model_name_or_path": str(model), "template": "qwen2_vl", "qwenvl_patch": True,
        "image_min_pixels": 256 * 28 * 28, "image_max_pixels": 1280 * 28 * 28, "stage": "grpo", "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "dataset": "bench", "dataset_dir": str(out / "data"),
        "cutoff_len": 4096, "output_dir": str(out / backend), "logging_steps": 1, "save_strategy": "no",
        "max_steps": args.steps, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "bf16": True,
        "learning_rate": 1e-5, "report_to": "none", "reward_funcs": "iou,format", "grpo_num_generations":
        args.generations, "max_new_tokens": args.new_tokens, "temperature": 1.0, "grpo_rollout_backend": backend,
        "grpo_vllm_gpu_memory_utilization": 0.35, "gradient_checkpointing": True, "seed": 0,
        "grpo_shared_prefix": shared, "flash_attn": "sdpa",
    }
    name = f"{backend}-{'shared' if shared else 'repeated'}"
    env = {**os.environ, "DISABLE_VERSION_CHECK": "1"}
    if tp is not None:  # ZeRO-3 over as many ranks as the largest size; one engine per ``tp`` ranks
        name = f"vllm-zero3-tp{tp}"
        config.update(grpo_vllm_tensor_parallel_size=tp, per_device_train_batch_size=1,
                      deepspeed=str(Path(__file__).resolve().parents[1] / "configs" / "ds_z3.json"))
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(max(args.tensor_parallel)))
    config["output_dir"] = str(out / name)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = Path(sys.executable).parent / "llamafactory-cli"
    subprocess.run([str(cli), "train", str(path)], check=True, env=env)
    rows = [json.loads(line) for line in (out / name / "trainer_log.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]

    def seconds(row: dict) -> float:
        h, m, s = (int(v) for v in row["elapsed_time"].split(":"))
        return h * 3600 + m * 60 + s

    per_step = (seconds(steps[-1]) - seconds(steps[0])) / max(len(steps) - 1, 1)
    result = {"seconds_per_step": round(per_step, 1),
              "peak_gib": max(row.get("memory/max_allocated_gib", 0.0) for row in steps)}
    for key in ("vllm/sync_seconds", "vllm/sync_added_gib"):
        if any(key in row for row in steps):
            result[key] = round(max(row.get(key, 0.0) for row in steps), 3)
    return result


def run_trl(out: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    """trl 0.24 on the same data, LoRA on every linear layer of the language model, bf16, checkpointing."""
    import statistics

    import torch
    from bench_grpo import LORA_TARGET, StepTimer, trl_format, trl_iou
    from datasets import Dataset
    from peft import LoraConfig
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl_compat import import_trl_grpo

    from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
    from llamafactory_qwenvl_patch.frame.policy_record import set_image_processor_bounds
    from llamafactory_qwenvl_patch.grpo.generation.settings import vision_token_ids

    GRPOConfig, GRPOTrainer = import_trl_grpo()
    processor = AutoProcessor.from_pretrained(model_dir, padding_side="left")
    set_image_processor_bounds(processor.image_processor, ResizePolicy(256 * 28 * 28, 1280 * 28 * 28))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.warnings_issued = {}
    records = json.loads((out / "data" / "bench.json").read_text())
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Locate the object; "
                                                                                           "answer bbox_2d JSON."}]}],
             "image": Image.open(out / "data" / r["images"][0]).convert("RGB"),
             "reference": r["messages"][1]["content"]} for r in records]

    config = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=2 * args.generations,
        num_generations=args.generations, gradient_accumulation_steps=2, max_steps=args.steps, logging_steps=1,
        save_strategy="no", learning_rate=1e-5, report_to="none", beta=0.04, temperature=1.0, top_k=0,
        max_completion_length=args.new_tokens, max_prompt_length=None, loss_type="grpo", bf16=True,
        gradient_checkpointing=True, seed=0,
        generation_kwargs={"suppress_tokens": vision_token_ids(processor.tokenizer)})
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_iou, trl_format], args=config,
                          train_dataset=Dataset.from_list(rows),
                          processing_class=processor, callbacks=[timer],
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGET))
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    return {"seconds_per_step": round(statistics.median(timer.times[1:] or timer.times), 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--tensor-parallel", type=int, nargs="+", metavar="N",
                        help="only the vLLM backend under ZeRO-3, at each of these tensor-parallel sizes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "qwen2_5_vl_7b_random"
    if not (model / "config.json").exists():
        build_checkpoint(model)
    write_data(args.out / "data")
    if args.tensor_parallel:
        results = {f"tp{tp}": run(args.out, model, "vllm", True, args, tp=tp) for tp in args.tensor_parallel}
        print(json.dumps({"results": results}, indent=2))
        return
    results = {f"{backend}-{'shared' if shared else 'repeated'}": run(args.out, model, backend, shared, args)
               for backend in ("hf", "vllm") for shared in (True, False)}
    results["trl"] = run_trl(args.out, model, args)
    base = results["hf-shared"]
    ratios = {f"hf-shared / {name}": {
        "step": round(base["seconds_per_step"] / max(result["seconds_per_step"], 1e-9), 3),
        "peak memory": round(base["peak_gib"] / max(result["peak_gib"], 1e-9), 3)}
        for name, result in results.items() if name != "hf-shared"}
    print(json.dumps({"results": results, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
