"""GRPO step time: ours (``stage: grpo`` via LF's ``run_exp``) vs trl 0.24's ``GRPOTrainer``, one run, same machine.

Same tiny random-weight Qwen2.5-VL, same image (already in the policy's frame, so both see the same image tokens),
same prompt, G completions of up to ``--new-tokens`` tokens (random weights never emit the stop token that early,
so both generate the full length; both logs show completion lengths), LoRA rank 8
on the language model's linear layers, beta 0.04 with the adapter-disabled model as reference, iou + format rewards,
loss ``grpo``, untruncated sampling with the vision tokens suppressed on both sides, one prompt per step, CPU. Step time is the median of the steps after the first; the two trainers run in
alternating rounds and the best round of each is compared.

``from trl import GRPOTrainer`` fails on this stack with ``No module named 'mergekit'``. Cause: trl 0.24's
``import_utils`` reads ``transformers.utils.import_utils._is_package_available(name)`` as a bool, but transformers 5.x
returns a ``(bool, version)`` tuple, which is always truthy, so trl believes every optional package (mergekit,
vllm, unsloth, ...) is installed and imports it. Unwrapping those tuples before importing the trainer is enough;
mergekit itself is not needed. trl 0.24 also writes ``model.warnings_issued``, which transformers 5.x models no
longer have; the script sets it to an empty dict.

    .venv/bin/python benchmarks/bench_grpo.py --steps 8 --generations 4 --new-tokens 16

``--learn`` compares learning instead of speed: the task of ``tests/test_grpo_learns.py`` (reward = how often the
completion says "cat", capped at 3), same tiny model, same 8 images in the same frame, same prompt, full fine-tuning,
2 prompts x 8 completions of 8 tokens per step, lr 1e-2 constant, beta 0, temperature 1, loss ``grpo``, same seeds;
trl with ``top_k=0`` (the distribution stage: grpo samples) and with its default ``top_k=None``, which
transformers 5.x turns into 50 at generate time. It prints the reward curves.

    .venv/bin/python benchmarks/bench_grpo.py --learn --steps 24 --seeds 0,1,2
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
    from llamafactory_qwenvl_patch.grpo.sampling import vision_token_ids
    from llamafactory_qwenvl_patch.policy_record import set_image_processor_bounds
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
        report_to="none", use_cpu=True, beta=0.04, temperature=1.0, top_k=0, max_completion_length=new_tokens,
        max_prompt_length=None, dataloader_num_workers=0, loss_type="grpo",
        bf16=False, generation_kwargs={"suppress_tokens": vision_token_ids(processor.tokenizer)},
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[iou, fmt], args=config, train_dataset=dataset,
                          processing_class=processor, callbacks=[timer],
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGET))
    trainer.train()
    return timer.median()


LEARN_PROMPT = "Locate the box and output its bbox_2d in JSON."
LEARN_MIN, LEARN_MAX = 4 * 28 * 28, 16 * 28 * 28


def target(completions, **kw) -> list[float]:
    """The verifiable toy reward: how often the completion says "cat", capped at 3."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [min(1.0, t.count("cat") / 3) for t in texts]


def make_learn_data(root: Path) -> list[Path]:
    from PIL import Image

    paths = []
    for i in range(8):
        path = root / f"learn{i}.jpg"
        Image.new("RGB", (100 + 37 * i, 90 + 23 * i), (20 * i, 100, 200)).save(path, quality=60)
        paths.append(path)
    records = [{"messages": [{"role": "user", "content": "<image>" + LEARN_PROMPT},
                             {"role": "assistant", "content": ANSWER}], "images": [str(p)]} for p in paths]
    (root / "learn.json").write_text(json.dumps(records))
    info = json.loads((root / "dataset_info.json").read_text())
    info["learn"] = {**info["toy"], "file_name": "learn.json"}
    (root / "dataset_info.json").write_text(json.dumps(info))
    return paths


def learn_ours(model: Path, data: Path, out: Path, steps: int, seed: int) -> list[float]:
    from llamafactory.train.tuner import run_exp

    run_exp({
        "model_name_or_path": str(model), "stage": "grpo", "do_train": True, "finetuning_type": "full",
        "qwenvl_patch": True, "image_min_pixels": LEARN_MIN, "image_max_pixels": LEARN_MAX, "dataset": "learn",
        "dataset_dir": str(data), "template": "qwen2_vl", "cutoff_len": 2048, "output_dir": str(out),
        "per_device_train_batch_size": 2, "max_steps": steps, "logging_steps": 1, "save_strategy": "no",
        "learning_rate": 1e-2, "lr_scheduler_type": "constant", "report_to": "none", "use_cpu": True, "seed": seed,
        "reward_funcs": f"{Path(__file__).resolve()}:target", "grpo_num_generations": 8, "grpo_beta": 0.0,
        "temperature": 1.0, "max_new_tokens": 8, "overwrite_cache": True, "dataloader_num_workers": 0,
    })
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [row["rewards/target/mean"] for row in rows if "loss" in row]


def learn_trl(model_dir: Path, images: list[Path], out: Path, steps: int, seed: int, top_k: int | None
              ) -> list[float]:
    """trl's top_k default (None) becomes transformers 5.x's global default 50 at generate time: truncated sampling
    while the loss uses the full softmax. ``top_k=0`` samples what stage: grpo samples."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from llamafactory_qwenvl_patch.grpo.sampling import vision_token_ids
    from llamafactory_qwenvl_patch.images import model_input_image
    from llamafactory_qwenvl_patch.policy_record import set_image_processor_bounds
    from llamafactory_qwenvl_patch.policy import ResizePolicy

    GRPOConfig, GRPOTrainer = import_trl_grpo()
    policy = ResizePolicy(LEARN_MIN, LEARN_MAX)
    processor = AutoProcessor.from_pretrained(model_dir, padding_side="left")
    set_image_processor_bounds(processor.image_processor, policy)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.warnings_issued = {}
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": LEARN_PROMPT}]}]
    dataset = Dataset.from_list([{"prompt": prompt, "image": model_input_image(str(p), policy)} for p in images])
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=16, num_generations=8, gradient_accumulation_steps=1,
        max_steps=steps, logging_steps=1, save_strategy="no", learning_rate=1e-2, lr_scheduler_type="constant",
        report_to="none", use_cpu=True, beta=0.0, temperature=1.0, top_p=1.0, top_k=top_k, max_completion_length=8,
        max_prompt_length=None, loss_type="grpo", scale_rewards="group", seed=seed, dataloader_num_workers=0,
        bf16=False,
        # without this trl 0.24 samples <|image_pad|> on the tiny model and crashes within a few steps
        # ("Image features and image tokens do not match"); stage: grpo suppresses the vision tokens itself
        generation_kwargs={"suppress_tokens": vision_token_ids(processor.tokenizer)},
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[target], args=config, train_dataset=dataset,
                          processing_class=processor)
    trainer.train()
    return [row["rewards/target/mean"] for row in trainer.state.log_history if "rewards/target/mean" in row]


def summary(curve: list[float]) -> dict:
    reached = next((i + 1 for i, r in enumerate(curve) if r >= 0.5), None)
    return {"first": round(curve[0], 3), "last4_mean": round(sum(curve[-4:]) / 4, 3), "first_step_at_0.5": reached,
            "curve": [round(r, 3) for r in curve]}


def main_learn(args: argparse.Namespace) -> None:
    from qwenvl_prep.tiny_model import build_tiny_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        make_data(root)
        images = make_learn_data(root)
        for seed in (int(s) for s in args.seeds.split(",")):
            results[f"seed {seed}"] = {
                "trl_0_24_top_k_0": summary(learn_trl(model, images, root / f"trl0-{seed}", args.steps, seed, 0)),
                "trl_0_24_default_top_k": summary(learn_trl(model, images, root / f"trl-{seed}", args.steps, seed,
                                                            None)),
                "ours": summary(learn_ours(model, root, root / f"ours-learn{seed}", args.steps, seed)),
            }
    print(json.dumps({"steps": args.steps, "results": results}))  # one line: trl prints its logs to stdout too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--learn", action="store_true", help="compare reward curves instead of step times")
    parser.add_argument("--seeds", default="0,1,2", help="seeds for --learn")
    args = parser.parse_args()
    if args.learn:
        main_learn(args)
        return
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
