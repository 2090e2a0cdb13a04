"""``qwenvl-prep demo OUT``: the whole pipeline on two CPU cores in a few minutes, on data and a model it makes
itself, ending with a model that finds the objects.

Synthesise coloured rectangles with known boxes (mixed image sizes) -> convert -> check -> a small random-weight
model -> ``llamafactory-cli train`` (SFT from scratch, full, vision unfrozen; then GRPO with iou + format rewards) ->
``llamafactory-cli export`` -> predict -> eval -> draw. Held-out metrics of the trained model are reported next to
the untrained model and a constant mean-box baseline, all measured in the same run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from llamafactory_qwenvl_patch.frame.families import DEFAULT, FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from qwenvl_prep.demos import gui
from qwenvl_prep.formats.converted import load_jsonl
from qwenvl_prep.demos.steps import (convert_and_check, export_full, full_training, grpo_stage, losses,
                                    new_run_folder, predict, run_step, sft_stage, small_model, steps_for,
                                    write_jsonl, write_yaml)

COLORS = {"red": (40, 40, 220), "green": (60, 180, 60), "blue": (220, 90, 40), "yellow": (40, 220, 230)}
# Original 4:3 photos of mixed sizes (320x240 to 960x720): all are larger than the frame's upper bound, so each is
# resized to one model frame (252x168 for Qwen2.5-VL, 256x192 for Qwen3-VL), and labels in original pixels and in
# the model's frame differ, as on real data. One frame size keeps the text positions after the image (M-RoPE starts them after the grid's longest side) in one
# place: a 1M-parameter model learns positions within minutes that way, and not with grids of many sizes (measured:
# Acc@0.5 4% vs 54% after 800 steps; with portrait 3:4 photos mixed in, mean IoU fell by about 0.05).
WIDTHS = (320, 960)
BOX_SHARE = (0.15, 0.6)  # each box side as a share of the image side (small boxes are not learned at this size)
MIN_PIXELS, MAX_PIXELS = 32 * 28 * 28, 64 * 28 * 28


def synthesise(folder: Path, count: int, seed: int) -> list[tuple[dict[str, Any], tuple[int, int]]]:
    """``count`` images, each one filled rectangle of one of four colours on a plain background: plain
    {image, question, answer} records labelled in original pixels, each with its image's (width, height)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    samples = []
    for i in range(count):
        w = rng.randint(*WIDTHS)
        h = round(w * 3 / 4)
        canvas = np.full((h, w, 3), rng.randint(200, 250), np.uint8)
        bw, bh = round(w * rng.uniform(*BOX_SHARE)), round(h * rng.uniform(*BOX_SHARE))
        x1, y1 = rng.randint(0, w - bw), rng.randint(0, h - bh)
        color, bgr = rng.choice(list(COLORS.items()))
        cv2.rectangle(canvas, (x1, y1), (x1 + bw - 1, y1 + bh - 1), bgr, -1)
        name = f"s{seed}_{i:04d}_{w}x{h}.jpg"
        cv2.imwrite(str(folder / name), canvas, [cv2.IMWRITE_JPEG_QUALITY, 90])
        label = f"{color} rectangle"
        samples.append(({"image": name, "question": f"Locate the {label} and output its bbox_2d in JSON.",
                         "answer": json.dumps([{"bbox_2d": [x1, y1, x1 + bw, y1 + bh], "label": label}])}, (w, h)))
    return samples


def mean_box_predictions(train: list, held_out: list, image_dir: Path, policy: ResizePolicy,
                         convention: str) -> list[dict[str, Any]]:
    """The constant baseline: the mean training box (as shares of the image sides) placed on every held-out image,
    written as ``qwenvl-prep predict`` rows in the model's own convention."""
    shares = []
    for record, (w, h) in train:
        x1, y1, x2, y2 = json.loads(record["answer"])[0]["bbox_2d"]
        shares.append((x1 / w, y1 / h, x2 / w, y2 / h))
    mean = [sum(column) / len(shares) for column in zip(*shares)]
    rows = []
    for record, (w, h) in held_out:
        orig = [mean[0] * w, mean[1] * h, mean[2] * w, mean[3] * h]
        box = convert_coords(orig, "orig", convention, (h, w), policy.model_size(h, w))
        label = json.loads(record["answer"])[0]["label"]
        rows.append({"image": str(image_dir / record["image"]),
                     "predict": json.dumps([{"bbox_2d": box, "label": label}])})
    return rows


SFT_BATCH = 8
# measured on 2 idle CPU cores (torch's default two threads, no dataloader worker, gradient checkpointing off): 6.96
# steps a second over 300 steps; with checkpointing 6.18, one thread beside a dataloader worker 5.77, two threads
# beside one 6.55, one thread alone 5.12 (the same losses in every setting)
SFT_STEPS_PER_MINUTE = 418
DEFAULT_MINUTES = 3.0
MAX_TRAIN_IMAGES = 1000  # seen 8 times by default: LF tokenizes an image about as slowly as it trains on it
GRPO_STEPS, GRPO_SMOKE_STEPS = 6, 2
GRPO_PROMPTS = 64  # GRPO's own small set: LF tokenizes the whole dataset before the first of a few steps
HELD_OUT, HELD_OUT_SMOKE = 100, 8


def run_demo(out: Path, minutes: float | None = None, family: str | None = None, task: str = "grounding",
             steps: int | None = None, seed: int = 0, controls: int | None = None) -> dict[str, Any]:
    """The grounding demo (a small model trained from scratch until it finds the rectangles), with ``task="gui"``
    the click one (``demos.gui``), with ``task="fields"`` the field-extraction one (``demos.fields``), with
    ``task="video"`` the video one (``demos.video``), or with ``task="agent"`` the multi-turn agent one
    (``demos.agent``). ``minutes``
    (each task has its default) becomes a fixed SFT step count; ``steps`` sets it directly; ``seed`` draws another
    run (other images and another initial model); ``family`` defaults to the task's own (``DEFAULT_FAMILY``);
    ``controls`` per screenshot is the gui demo's (default 1)."""
    if (steps is not None and steps < 1) or (minutes is not None and minutes <= 0):
        raise ValueError(f"the demo needs --steps >= 1 and --minutes > 0, got {steps} and {minutes}")
    if controls is not None and task != "gui":
        raise ValueError("--controls applies to the gui demo (--task gui)")
    controls = 1 if controls is None else controls
    if not 1 <= controls <= gui.MAX_CONTROLS:
        raise ValueError(f"--controls must be 1 to {gui.MAX_CONTROLS}, got {controls}")
    if task == "fields":
        if family not in (None, "qwen2_5_vl"):
            raise ValueError("--family applies to the grounding and gui demos; the fields demo uses Qwen2.5-VL")
        from qwenvl_prep.demos.fields import run_fields_demo

        return run_fields_demo(out, minutes, steps, seed)
    if task == "video":
        if family is not None and (family not in FAMILIES or not FAMILIES[family].tiny):
            raise ValueError(f"demo family must be one of {', '.join(f for f in FAMILIES if FAMILIES[f].tiny)}, "
                             f"got {family!r}")
        from qwenvl_prep.demos.video import run_video_demo

        return run_video_demo(out, steps, minutes, family, seed)
    if task == "agent":
        if family is not None and (family not in FAMILIES or not FAMILIES[family].tiny):
            raise ValueError(f"demo family must be one of {', '.join(f for f in FAMILIES if FAMILIES[f].tiny)}, "
                             f"got {family!r}")
        from qwenvl_prep.demos import agent

        return agent.run_agent_demo(out, steps or steps_for(minutes or agent.DEFAULT_MINUTES,
                                                            agent.SFT_STEPS_PER_MINUTE), family or agent.DEFAULT_FAMILY,
                                    seed)
    if task not in ("grounding", "gui"):
        raise ValueError(f"demo task must be grounding, gui, fields, video or agent, got {task!r}")
    if family is None:
        family = gui.DEFAULT_FAMILY if task == "gui" else DEFAULT
    if family not in FAMILIES or not FAMILIES[family].tiny:
        raise ValueError(f"demo family must be one of {', '.join(f for f in FAMILIES if FAMILIES[f].tiny)}, "
                         f"got {family!r}")
    if task == "gui":
        return gui.run_gui_demo(out, steps or steps_for(minutes or gui.DEFAULT_MINUTES, gui.SFT_STEPS_PER_MINUTE),
                                family, seed, controls)
    steps = steps or steps_for(minutes or DEFAULT_MINUTES, SFT_STEPS_PER_MINUTE)
    out, logs = new_run_folder(out)
    data, raw = out / "data", out / "raw"
    learning = steps >= 50  # fewer steps: a smoke run, with fewer held-out images and GRPO steps
    train = synthesise(raw, min(MAX_TRAIN_IMAGES, max(64, steps * SFT_BATCH)), seed=2 * seed)
    held_out = synthesise(raw, HELD_OUT if learning else HELD_OUT_SMOKE, seed=2 * seed + 1)
    write_jsonl(raw / "train.jsonl", [record for record, _ in train])
    write_jsonl(raw / "grpo.jsonl", [record for record, _ in train[:GRPO_PROMPTS]])
    write_jsonl(raw / "eval.jsonl", [record for record, _ in held_out])
    policy = ResizePolicy(MIN_PIXELS, MAX_PIXELS, FAMILIES[family].factor)
    model = small_model(out / "model", family, policy, logs, seed)
    common = full_training(family, data, "demo_train", policy)
    # gradient checkpointing recomputes every forward of a model this small for no memory it needs: 11% of a step
    sft_yaml = write_yaml(out / "sft.yaml", {**sft_stage(common, model, out / "sft", steps, SFT_BATCH),
                                             "disable_gradient_checkpointing": True})
    convert_and_check({split: raw / f"{split}.jsonl" for split in ("train", "grpo", "eval")}, data, "demo", sft_yaml,
                      ["--input-coords", "abs"], logs)
    evaluated = {}

    def predict_and_eval(name: str, model_dir: Path) -> None:
        predictions = out / f"predictions-{name}.jsonl"
        if model_dir is not None:
            predict(name, model_dir, data / "demo_eval.json", predictions, logs)
        run_step(f"eval-{name}", ["qwenvl-prep", "eval", str(data / "demo_eval.json"), "--predictions",
                                  str(predictions), "--json-out", str(out / f"eval-{name}.json")], logs)
        evaluated[name] = json.loads((out / f"eval-{name}.json").read_text())["overall"]

    write_jsonl(out / "predictions-baseline.jsonl",
                mean_box_predictions(train, held_out, raw, policy, FAMILIES[family].coords))
    predict_and_eval("baseline", None)
    predict_and_eval("untrained", model)
    run_step("train-sft", ["llamafactory-cli", "train", str(sft_yaml)], logs)
    grpo_yaml = write_yaml(out / "grpo.yaml", grpo_stage(common, out / "sft", out / "grpo", "demo_grpo", "iou,format",
                                                         GRPO_STEPS if learning else GRPO_SMOKE_STEPS, 64))
    run_step("train-grpo", ["llamafactory-cli", "train", str(grpo_yaml)], logs)
    export_full(out / "grpo", out / "exported", family, policy, sft_yaml, logs)
    predict_and_eval("trained", out / "exported")
    run_step("draw", ["qwenvl-prep", "draw", str(data / "demo_eval.json"), "-o", str(out / "drawn"), "--sample", "16",
                      "--predictions", str(out / "predictions-trained.jsonl")], logs)
    grpo_reward = [row["reward"] for row in load_jsonl(out / "grpo" / "trainer_log.jsonl") if "reward" in row]
    return {
        "family": family, "seed": seed, "sft_steps": steps, "train_images": len(train),
        "held_out_images": len(held_out),
        "held_out": {name: _headline(metrics) for name, metrics in evaluated.items()},
        "trained_vs_baseline": _ratios(evaluated["trained"], evaluated["baseline"]),
        "grpo_reward_first_last": [grpo_reward[0], grpo_reward[-1]],
        "sft_loss_first_last": [sft_loss[0], sft_loss[-1]] if (sft_loss := losses(out / "sft")) else None,
        "data": str(data), "exported": str(out / "exported"), "drawn": str(out / "drawn"), "logs": str(logs),
    }


def _headline(metrics: dict[str, Any]) -> dict[str, Any]:
    keys = ("acc@0.5", "mean_iou", "mean_centre_offset_orig_px", "parse_failure_rate")
    return {key: metrics.get(key) for key in keys}


def _ratios(trained: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """Trained over baseline for Acc@0.5 and mean IoU (None when the baseline scores 0: no ratio to speak of)."""
    return {key: round(trained[key] / baseline[key], 2) if baseline.get(key) else None
            for key in ("acc@0.5", "mean_iou")}


def format_summary(summary: dict[str, Any]) -> str:
    """The held-out table a person reads at the end of the demo (the JSON summary goes to stdout)."""
    names = {"trained": "trained (SFT + GRPO)", "baseline": "mean-box baseline", "untrained": "untrained"}
    lines = [f"held-out images: {summary['held_out_images']} ({summary['family']}, {summary['sft_steps']} SFT steps)",
             f"{'':22}{'Acc@0.5':>9}{'mean IoU':>10}{'centre offset (orig px)':>25}"]
    for key, name in names.items():
        m = summary["held_out"][key]
        offset = "-" if m["mean_centre_offset_orig_px"] is None else f"{m['mean_centre_offset_orig_px']:.1f}"
        lines.append(f"{name:22}{m['acc@0.5']:>9.2f}{m['mean_iou']:>10.3f}{offset:>25}")
    ratios = summary["trained_vs_baseline"]
    lines.append(f"trained / baseline: Acc@0.5 {ratios['acc@0.5']}x, mean IoU {ratios['mean_iou']}x")
    first, last = summary["grpo_reward_first_last"]
    lines.append(f"GRPO reward (iou + format): first step {first:.3f}, last step {last:.3f}")
    lines.append(f"boxes drawn on the original images: {summary['drawn']}")
    return "\n".join(lines)
