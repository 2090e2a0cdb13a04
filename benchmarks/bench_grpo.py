"""GRPO step time and peak memory: the shared prefix (``stage: grpo``'s default), the repeated layout (our previous
code, ``grpo_shared_prefix: false``) and trl 0.24's ``GRPOTrainer``, one run, interleaved rounds.

``--shape grounding``: one 896x896 image (1,024 image tokens, 1,065 prompt tokens) and 40-token completions, the
shape of box grounding; ``--shape text``: a short text prompt and 256-token completions; ``--shape video``: an 8-s
448x448 clip (16 frames at 2 fps, 2,048 video tokens) and 40-token completions, the shape of temporal grounding
(format reward only; trl's GRPOTrainer takes no videos, so ``--configs shared,repeated``). The ``small`` tiny
Qwen2.5-VL (``qwenvl-prep tiny-model --size small``, random weights), LoRA rank 8 on the language model, beta 0.04
with the adapter-disabled reference, iou + format rewards, loss ``grpo``, temperature 1 without truncation, the
vision tokens and the stop tokens suppressed on every side (so every completion runs to full length; each row
reports the mean completion length to show it), one prompt of G completions per step, CPU, fp32.

Each configuration runs in its own process (``llamafactory-cli``'s ``run_exp`` for ours), so peak memory is its own:
the largest resident set during training minus the resident set when training starts (sampled every 2 ms: model
weights and imports excluded; activations, caches, optimiser state and allocator slack included). Step time is the
median of the steps after the first; rounds interleave the configurations so drift of the machine hits all alike,
and the best round of each is reported::

    .venv/bin/python benchmarks/bench_grpo.py --shape grounding --generations 8,16
    .venv/bin/python benchmarks/bench_grpo.py --shape text --generations 8
    .venv/bin/python benchmarks/bench_grpo.py --shape grounding --generations 8 --family qwen3_5
    .venv/bin/python benchmarks/bench_grpo.py --shape video --generations 8 --configs shared,repeated

``from trl import GRPOTrainer`` fails on this stack with ``No module named 'mergekit'``: see ``trl_compat.py``. trl
0.24 also writes ``model.warnings_issued``, which transformers 5.x models no longer have; the script sets it to an
empty dict.

``--learn`` compares learning instead of speed: the task of ``tests/cli/test_grpo_learns.py`` (reward = how often the
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
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from transformers import TrainerCallback
from trl_compat import import_trl_grpo

os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
MIN_PIXELS, MAX_PIXELS = 64 * 28 * 28, 256 * 28 * 28  # the --learn task's toy data
# the language model's projections, Qwen3.5's linear-attention ones included (absent names match nothing)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z",
                "in_proj_b", "in_proj_a", "out_proj")
LORA_TARGET = rf".*language_model.*\.({'|'.join(LORA_MODULES)})"
PROMPT = "Locate the blue square and output its bbox_2d in JSON."
ANSWER = '[{"bbox_2d": [10, 20, 110, 120], "label": "blue square"}]'
SHAPES = {
    # 896 x 896 = 1,024 image tokens of 28 x 28 under these bounds
    "grounding": dict(side=896, min_pixels=256 * 28 * 28, max_pixels=1024 * 28 * 28, new_tokens=40,
                      prompt=PROMPT, generations="8,16"),
    "text": dict(side=None, min_pixels=64 * 28 * 28, max_pixels=256 * 28 * 28, new_tokens=256,
                 prompt="Write a long story about a cat who finds a red box.", generations="8"),
    # an 8-s clip of 448 x 448 at 30 fps: 16 frames at 2 fps, 8 groups of 256 tokens (2,048 video tokens)
    "video": dict(side=448, seconds=8, min_pixels=64 * 28 * 28, max_pixels=256 * 28 * 28, new_tokens=40,
                  video_max_pixels=256 * 28 * 28, prompt="When is the square on screen? Answer {\"span\": [start, "
                  "end]} in seconds.", generations="8"),
}
VIDEO_ANSWER = '{"span": [2.0, 6.0]}'


class StepTimer(TrainerCallback):
    """Step times, and the peak resident set during training above the one at its start (a 2 ms sampler)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0
        self._base = 0
        self.peak = 0
        self._stop = threading.Event()

    def on_train_begin(self, args, state, control, **kwargs):
        self._base = self.peak = _rss()
        threading.Thread(target=self._sample, daemon=True).start()

    def on_train_end(self, args, state, control, **kwargs):
        self._stop.set()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)
        self.peak = max(self.peak, _rss())

    def result(self) -> dict[str, float]:
        return {"step_s": statistics.median(self.times[1:] or self.times),
                "peak_mib": (self.peak - self._base) / 2**20}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sharegpt(root: Path, name: str, records: list[dict]) -> None:
    (root / f"{name}.json").write_text(json.dumps(records))
    info_path = root / "dataset_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    columns = {"messages": "messages", **{key: key for key in ("images", "videos") if key in records[0]}}
    info[name] = {"file_name": f"{name}.json", "formatting": "sharegpt", "columns": columns,
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant"}}
    info_path.write_text(json.dumps(info))


def make_data(root: Path, shape: str) -> Path | None:
    """The shape's dataset (64 copies of one record); returns its image, already in the policy's frame."""
    from PIL import Image

    spec = SHAPES[shape]
    user = {"role": "user", "content": spec["prompt"]}
    record: dict = {"messages": [user, {"role": "assistant", "content": ANSWER}]}
    image = None
    if shape == "video":
        clip = write_clip(root / "video.mp4", spec["seconds"], spec["side"])
        record = {"messages": [dict(user, content="<video>" + spec["prompt"]),
                               {"role": "assistant", "content": VIDEO_ANSWER}], "videos": [str(clip)]}
    elif spec["side"]:
        rng = random.Random(0)
        image = root / f"{shape}.png"
        pixels = bytes(rng.randrange(256) for _ in range(spec["side"] * spec["side"] * 3))
        Image.frombytes("RGB", (spec["side"], spec["side"]), pixels).save(image)
        record = {"messages": [dict(user, content="<image>" + spec["prompt"]), record["messages"][1]],
                  "images": [str(image)]}
    _sharegpt(root, shape, [record] * 64)
    return image


def write_clip(path: Path, seconds: int, side: int, fps: int = 30) -> Path:
    """A noise clip whose middle half shows a white square (PyAV, mpeg4)."""
    import av
    import numpy as np

    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        for i in range(seconds * fps):
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            if seconds * fps // 4 <= i < 3 * seconds * fps // 4:
                pixels[side // 4:side // 2, side // 4:side // 2] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def run_ours(model: Path, data: Path, out: Path, shape: str, steps: int, generations: int, shared: bool,
             family: str) -> dict[str, float]:
    from llamafactory.train.tuner import run_exp

    from llamafactory_qwenvl_patch.frame.families import FAMILIES, LF_VIDEO_DEFAULTS

    spec = SHAPES[shape]
    timer = StepTimer()
    run_exp({
        "model_name_or_path": str(model), "stage": "grpo", "do_train": True, "finetuning_type": "lora",
        "lora_rank": 8, "lora_target": ",".join(LORA_MODULES),
        "qwenvl_patch": True, "image_min_pixels": spec["min_pixels"], "image_max_pixels": spec["max_pixels"],
        "dataset": shape, "dataset_dir": str(data), "template": FAMILIES[family].default_template,
        "cutoff_len": 4096, "output_dir": str(out), "per_device_train_batch_size": 1, "max_steps": steps, "logging_steps": 1,
        "save_strategy": "no", "learning_rate": 1e-4, "report_to": "none", "use_cpu": True,
        "reward_funcs": "format" if shape == "video" else "iou,format", "grpo_num_generations": generations,
        "grpo_beta": 0.04, "temperature": 1.0,
        "video_max_pixels": spec.get("video_max_pixels", LF_VIDEO_DEFAULTS["video_max_pixels"]),
        "max_new_tokens": spec["new_tokens"], "overwrite_cache": True, "dataloader_num_workers": 0,
        "grpo_shared_prefix": shared,
    }, callbacks=[timer])
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    lengths = [row["completion_length/mean"] for row in rows if "completion_length/mean" in row]
    return {**timer.result(), "completion_length": statistics.mean(lengths)}


def _texts(completions: list) -> list[str]:
    return [c[0]["content"] if isinstance(c, list) else c for c in completions]


def trl_iou(completions, reference, **kw) -> list[float]:
    """Our ``iou`` reward in trl's calling convention (conversational completions, dataset columns as keywords)."""
    from llamafactory_qwenvl_patch.grpo.rewards.builtin import iou_reward

    return iou_reward(_texts(completions), references=reference)


def trl_format(completions, reference, **kw) -> list[float]:
    from llamafactory_qwenvl_patch.grpo.rewards.builtin import format_reward

    return format_reward(_texts(completions), references=reference)


def run_trl(model_dir: Path, data: Path, out: Path, shape: str, steps: int, generations: int, family: str
            ) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from llamafactory_qwenvl_patch.frame.families import FAMILIES
    from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
    from llamafactory_qwenvl_patch.frame.policy_record import set_image_processor_bounds

    spec = SHAPES[shape]
    GRPOConfig, GRPOTrainer = import_trl_grpo()
    processor = AutoProcessor.from_pretrained(model_dir, padding_side="left")
    set_image_processor_bounds(processor.image_processor, ResizePolicy(spec["min_pixels"], spec["max_pixels"],
                                                                       FAMILIES[family].factor))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.warnings_issued = {}  # trl 0.24 writes to this transformers 4.x attribute, gone in 5.x
    content = [{"type": "text", "text": spec["prompt"]}]
    row: dict = {"reference": ANSWER}
    if spec["side"]:
        content = [{"type": "image"}, *content]
        row["image"] = Image.open(data / f"{shape}.png").convert("RGB")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": content}], **row}] * 64)
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=generations, num_generations=generations,
        gradient_accumulation_steps=1, max_steps=steps, logging_steps=1, save_strategy="no", learning_rate=1e-4,
        report_to="none", use_cpu=True, beta=0.04, temperature=1.0, top_k=0, max_completion_length=spec["new_tokens"],
        max_prompt_length=None, dataloader_num_workers=0, loss_type="grpo",
        bf16=False, generation_kwargs={"suppress_tokens": full_length_suppression(processor.tokenizer)},
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_iou, trl_format], args=config, train_dataset=dataset,
                          processing_class=processor, callbacks=[timer],
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGET))
    trainer.train()
    lengths = [r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r]
    return {**timer.result(), "completion_length": statistics.mean(lengths)}


def full_length_suppression(tokenizer) -> list[int]:
    """The vision tokens and the stop tokens: suppressing the stop tokens too makes every completion run to
    ``max_new_tokens`` on every side, so the configurations do the same work."""
    from llamafactory_qwenvl_patch.grpo.generation.settings import VISION_TOKENS

    return sorted({tokenizer.convert_tokens_to_ids(t) for t in (*VISION_TOKENS, "<|im_end|>", "<|endoftext|>")})


def worker(spec: dict) -> None:
    """One configuration in this process; prints its result as the last line."""
    import torch

    import llamafactory_qwenvl_patch.grpo.generation.settings as sampling

    sampling.vision_token_ids = full_length_suppression  # read by stage: grpo when the run starts
    torch.manual_seed(0)
    root, out = Path(spec["root"]), Path(spec["out"])
    if spec["config"] == "trl":
        result = run_trl(root / "model", root, out, spec["shape"], spec["steps"], spec["generations"],
                         spec["family"])
    else:
        result = run_ours(root / "model", root, out, spec["shape"], spec["steps"], spec["generations"],
                          shared=spec["config"] == "shared", family=spec["family"])
    print(json.dumps(result))


def run_worker(spec: dict) -> dict[str, float]:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    if proc.returncode:
        raise RuntimeError(f"{spec['config']} G {spec['generations']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main_speed(args: argparse.Namespace) -> None:
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    spec = SHAPES[args.shape]
    generations = [int(g) for g in (args.generations or spec["generations"]).split(",")]
    configs = args.configs.split(",")
    runs: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_tiny_model(root / "model", family=args.family, size="small")
        make_data(root, args.shape)
        for round_ in range(args.rounds):  # interleaved, so drift of the machine hits every configuration alike
            for g in generations:
                for config in configs:
                    if f"{config} G{g}" in failures:
                        continue
                    try:
                        result = run_worker({"root": str(root), "out": str(root / f"{config}-{g}-{round_}"),
                                             "config": config, "shape": args.shape, "steps": args.steps,
                                             "generations": g, "family": args.family})
                    except RuntimeError as error:  # a peer that cannot train this family: say why, go on
                        lines = str(error).strip().splitlines()
                        failures[f"{config} G{g}"] = next((line for line in reversed(lines) if "Error" in line),
                                                          lines[-1])
                        continue
                    runs.setdefault(f"{config} G{g}", []).append(result)
                    print(f"round {round_} {config} G{g}: {result}", file=sys.stderr)
    best = {key: min(results, key=lambda r: r["step_s"]) for key, results in runs.items()}
    table = {key: {"step_s": round(r["step_s"], 3), "peak_mib": round(r["peak_mib"], 1),
                   "completion_length": round(r["completion_length"], 1),
                   "step_s_rounds": [round(x["step_s"], 3) for x in runs[key]]} for key, r in best.items()}
    ratios = {}
    for g in generations:
        shared = best.get(f"shared G{g}")
        for other in ("repeated", "trl"):
            if shared and f"{other} G{g}" in best:
                ratios[f"G{g} shared/{other} step"] = round(shared["step_s"] / best[f"{other} G{g}"]["step_s"], 3)
                ratios[f"G{g} shared/{other} peak memory"] = round(
                    shared["peak_mib"] / max(best[f"{other} G{g}"]["peak_mib"], 1e-9), 3)
    for config in configs:
        if len(generations) > 1 and all(f"{config} G{g}" in best for g in generations):
            low, high = min(generations), max(generations)
            ratios[f"{config} G{high}/G{low} step"] = round(
                best[f"{config} G{high}"]["step_s"] / best[f"{config} G{low}"]["step_s"], 3)
    print(json.dumps({"family": args.family, "shape": args.shape, "steps": args.steps, "rounds": args.rounds, "new_tokens":
                      spec["new_tokens"], "results": table, "ratios": ratios, "failed": failures}, indent=2))


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
    _sharegpt(root, "learn", records)
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

    from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
    from llamafactory_qwenvl_patch.frame.policy_record import set_image_processor_bounds
    from llamafactory_qwenvl_patch.grpo.generation.settings import vision_token_ids
    from llamafactory_qwenvl_patch.image_io.images import model_input_image

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
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
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
    parser.add_argument("--shape", choices=sorted(SHAPES), default="grounding")
    parser.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_5"],
                        help="the small tiny model's family (qwen3_5: Gated DeltaNet and full-attention layers; "
                        "factor 32, so the grounding image is 784 tokens)")
    parser.add_argument("--generations", help="comma-separated G values (grounding: 8,16; text: 8)")
    parser.add_argument("--configs", default="shared,repeated,trl", help="which of shared,repeated,trl to run")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--learn", action="store_true", help="compare reward curves instead of step times")
    parser.add_argument("--seeds", default="0,1,2", help="seeds for --learn")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
    elif args.learn:
        main_learn(args)
    else:
        main_speed(args)


if __name__ == "__main__":
    main()
