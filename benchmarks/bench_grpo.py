"""GRPO step time: ours (``stage: grpo`` via LF's ``run_exp``) vs trl 0.24's ``GRPOTrainer``, one run, same machine.

Same tiny random-weight Qwen2.5-VL, same image (already in the policy's frame, so both see the same image tokens),
same prompt, G completions of up to ``--new-tokens`` tokens (random weights never emit the stop token that early,
so both generate the full length; both logs show completion lengths), LoRA rank 8
on the language model's linear layers, beta 0.04 with the adapter-disabled model as reference, iou + format rewards,
one prompt per step, CPU. Step time is the median of the steps after the first; the two trainers run in
alternating rounds and the best round of each is compared.

``from trl import GRPOTrainer`` fails on this stack with ``No module named 'mergekit'``. Cause: trl 0.24's
``import_utils`` reads ``transformers.utils.import_utils._is_package_available(name)`` as a bool, but transformers 5.x
returns a ``(bool, version)`` tuple, which is always truthy, so trl believes every optional package (mergekit,
vllm, unsloth, ...) is installed and imports it. Unwrapping those tuples before importing the trainer is enough;
mergekit itself is not needed. trl 0.24 also writes ``model.warnings_issued``, which transformers 5.x models no
longer have; the script sets it to an empty dict.

    .venv/bin/python benchmarks/bench_grpo.py --steps 8 --generations 4 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from transformers import TrainerCallback

from trl_compat import import_trl_grpo

os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
MIN_PIXELS, MAX_PIXELS = 64 * 28 * 28, 256 * 28 * 28
LORA_TARGET = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
PROMPT = "Locate the blue square and output its bbox_2d in JSON."
ANSWER = '[{"bbox_2d": [10, 20, 110, 120], "label": "blue square"}]'


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)

    def median(self) -> float:
        return statistics.median(self.times[1:] or self.times)


def make_data(root: Path) -> Path:
    from llamafactory_qwenvl_patch.images import model_input_image
    from llamafactory_qwenvl_patch.policy import ResizePolicy
    from PIL import Image

    raw = root / "raw.jpg"
    Image.new("RGB", (1920, 1080), (30, 60, 200)).save(raw)
    image = model_input_image(str(raw), ResizePolicy(MIN_PIXELS, MAX_PIXELS))
    path = root / "image.png"
    image.save(path)
    record = {"messages": [{"role": "user", "content": "<image>" + PROMPT}, {"role": "assistant", "content": ANSWER}],
              "images": [str(path)]}
    (root / "toy.json").write_text(json.dumps([record] * 64))
    (root / "dataset_info.json").write_text(json.dumps({"toy": {
        "file_name": "toy.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    return path


def run_ours(model: Path, data: Path, out: Path, steps: int, generations: int, new_tokens: int) -> float:
    from llamafactory.train.tuner import run_exp

    timer = StepTimer()
    run_exp({
        "model_name_or_path": str(model), "stage": "grpo", "do_train": True, "finetuning_type": "lora",
        "lora_rank": 8, "lora_target": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "qwenvl_patch": True, "image_min_pixels": MIN_PIXELS, "image_max_pixels": MAX_PIXELS, "dataset": "toy",
        "dataset_dir": str(data), "template": "qwen2_vl", "cutoff_len": 2048, "output_dir": str(out),
        "per_device_train_batch_size": 1, "max_steps": steps, "logging_steps": 1, "save_strategy": "no",
        "learning_rate": 1e-4, "report_to": "none", "use_cpu": True, "reward_funcs": "iou,format",
        "grpo_num_generations": generations, "grpo_beta": 0.04, "temperature": 1.0, "max_new_tokens": new_tokens, "overwrite_cache": True, "dataloader_num_workers": 0,
    }, callbacks=[timer])
    return timer.median()


def run_trl(model_dir: Path, image_path: Path, out: Path, steps: int, generations: int, new_tokens: int) -> float:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from llamafactory_qwenvl_patch.grpo.rewards import format_reward, iou_reward
    from llamafactory_qwenvl_patch.lf_patch import set_image_processor_bounds
    from llamafactory_qwenvl_patch.policy import ResizePolicy

    GRPOConfig, GRPOTrainer = import_trl_grpo()
    processor = AutoProcessor.from_pretrained(model_dir, padding_side="left")
    set_image_processor_bounds(processor.image_processor, ResizePolicy(MIN_PIXELS, MAX_PIXELS))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.warnings_issued = {}  # trl 0.24 writes to this transformers 4.x attribute, gone in 5.x
    image = Image.open(image_path).convert("RGB")
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    dataset = Dataset.from_list([{"prompt": prompt, "image": image, "reference": ANSWER}] * 64)

    def text_of(completions):
        return [c[0]["content"] if isinstance(c, list) else c for c in completions]

    def iou(completions, reference, **kw):
        return iou_reward(text_of(completions), references=reference)

    def fmt(completions, reference, **kw):
        return format_reward(text_of(completions), references=reference)

    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=generations, num_generations=generations,
        gradient_accumulation_steps=1, max_steps=steps, logging_steps=1, save_strategy="no", learning_rate=1e-4,
        report_to="none", use_cpu=True, beta=0.04, temperature=1.0, max_completion_length=new_tokens,
        max_prompt_length=None, dataloader_num_workers=0,
        bf16=False,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[iou, fmt], args=config, train_dataset=dataset,
                          processing_class=processor, callbacks=[timer],
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGET))
    trainer.train()
    return timer.median()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.manual_seed(0)
    from qwenvl_prep.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        image = make_data(root)
        trl_runs, our_runs = [], []
        for round_ in range(args.rounds):  # interleaved, so drift of the machine hits both sides alike
            trl_runs.append(run_trl(model, image, root / f"trl{round_}", args.steps, args.generations,
                                    args.new_tokens))
            our_runs.append(run_ours(model, root, root / f"ours{round_}", args.steps, args.generations,
                                     args.new_tokens))
    trl_step, ours_step = min(trl_runs), min(our_runs)
    print(json.dumps({
        "steps": args.steps, "rounds": args.rounds, "generations": args.generations, "new_tokens": args.new_tokens,
        "trl_0_24_step_s": [round(t, 4) for t in trl_runs], "ours_step_s": [round(t, 4) for t in our_runs],
        "ours_over_trl_best_of_rounds": round(ours_step / trl_step, 3),
    }, indent=2))


if __name__ == "__main__":
    main()
