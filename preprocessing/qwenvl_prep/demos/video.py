"""``qwenvl-prep demo OUT --task video``: temporal grounding on 2 CPU cores, ending with a model that tells when.

Synthesise short clips in which a coloured square appears, moves across and leaves (at whole seconds, so a span is
read off the frame groups), written as a Charades-STA-style file (``video-span``) -> a small random-weight model ->
``qwenvl-prep convert --format video-span`` in the run's video frame and clock -> ``check`` -> SFT from scratch ->
a few GRPO steps on video prompts (``tiou,format``) -> export -> ``predict`` on held-out clips -> ``eval`` (R@1 at
tIoU 0.3/0.5/0.7, mean tIoU). The untrained model and a constant baseline (the training spans' mean) are scored on
the same held-out clips in the same run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from qwenvl_prep.demos.steps import (ONE_THREAD, export_full, full_training, grpo_stage, losses, new_run_folder,
                                     predict, run_step, sft_stage, steps_for, write_jsonl, write_yaml)
from qwenvl_prep.formats.converted import load_jsonl

DEFAULT_FAMILY = "qwen3_vl"  # its clock is a text stamp before each frame group, which a small model can copy
COLORS = {"red": (220, 40, 40), "green": (60, 190, 60), "blue": (50, 90, 230), "yellow": (230, 220, 40)}
WIDTH, HEIGHT, SECONDS, FPS = 96, 64, 8, 8
VIDEO_KEYS = {"video_min_pixels": 1024, "video_max_pixels": 96 * 64, "video_fps": 2.0, "video_maxlen": 16}
MIN_PIXELS, MAX_PIXELS = 1024, 96 * 64  # no still images here; the image keys only pin the run like the others
SFT_BATCH = 8
# measured on 2 idle CPU cores, torch on one thread (as the demo trains): 1.815 steps a second over 150 steps. The
# loss stays near 0.26 until about step 500 of 900 (the span digits come last), so the default is 900 steps.
SFT_STEPS_PER_MINUTE = 109
DEFAULT_MINUTES = 900 / SFT_STEPS_PER_MINUTE
TRAIN_CLIPS, HELD_OUT, HELD_OUT_SMOKE = 400, 64, 8
GRPO_STEPS, GRPO_SMOKE_STEPS = 6, 2


def write_clip(path: Path, color: tuple[int, int, int], start: int, end: int, rng: random.Random) -> None:
    """A clip of SECONDS seconds: dim noise, and from ``start`` to ``end`` seconds a square moving left to right."""
    import av

    side = HEIGHT // 2
    noise = np.random.default_rng(rng.randrange(2**32))
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        y = rng.randrange(0, HEIGHT - side)
        for i in range(SECONDS * FPS):
            pixels = noise.integers(0, 40, (HEIGHT, WIDTH, 3), dtype=np.uint8)
            t = i / FPS
            if start <= t < end:
                x = int((WIDTH - side) * (t - start) / max(end - start, 1))
                pixels[y:y + side, x:x + side] = color
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())


def synthesise(folder: Path, count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` clips and their ``video-span`` entries (spans at whole seconds, at least one second long)."""
    rng = random.Random(seed)
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    entries = []
    for k in range(count):
        name = rng.choice(sorted(COLORS))
        start = rng.randrange(0, SECONDS - 1)
        end = rng.randrange(start + 1, SECONDS + 1)
        clip = folder / "clips" / f"s{seed}-{k}.mp4"
        write_clip(clip, COLORS[name], start, end, rng)
        entries.append({"video": str(clip.relative_to(folder)), "query": f"the {name} square",
                        "timestamp": [start, end], "duration": SECONDS})
    return entries


def mean_span_predictions(train: list[dict], held_out: list[dict], folder: Path) -> list[dict[str, Any]]:
    """The constant baseline: the training spans' mean start and end for every held-out clip, as predict rows."""
    start = round(sum(e["timestamp"][0] for e in train) / len(train), 1)
    end = round(sum(e["timestamp"][1] for e in train) / len(train), 1)
    return [{"video": str(folder / e["video"]), "predict": json.dumps({"span": [start, end]})} for e in held_out]


def run_video_demo(out: Path, steps: int | None, minutes: float | None, family: str | None, seed: int
                   ) -> dict[str, Any]:
    """The whole run into ``out``; returns the JSON summary. ``minutes`` becomes a fixed SFT step count."""
    family = family or DEFAULT_FAMILY
    steps = steps or steps_for(minutes or DEFAULT_MINUTES, SFT_STEPS_PER_MINUTE)
    out, logs = new_run_folder(out)
    data, raw = out / "data", out / "raw"
    learning = steps >= 50
    train = synthesise(raw, TRAIN_CLIPS if learning else 16, seed=2 * seed)
    held_out = synthesise(raw, HELD_OUT if learning else HELD_OUT_SMOKE, seed=2 * seed + 1)
    write_jsonl(raw / "train.jsonl", train)
    write_jsonl(raw / "grpo.jsonl", train[:32])
    write_jsonl(raw / "eval.jsonl", held_out)
    f = FAMILIES[family]
    policy = ResizePolicy(MIN_PIXELS, MAX_PIXELS, f.factor)
    video = VideoPolicy.from_lf_keys(VIDEO_KEYS, f.factor, f.video_clock)
    model = out / "model"
    run_step("tiny-model", ["qwenvl-prep", "tiny-model", str(model), "--family", family, "--size", "small",
                            "--seed", str(seed)], logs)
    write_policy_record(model, policy, video)
    common = {**full_training(family, data, "demo_train", policy), **VIDEO_KEYS}
    sft_yaml = write_yaml(out / "sft.yaml", {**sft_stage(common, model, out / "sft", steps, SFT_BATCH),
                                             "disable_gradient_checkpointing": True})
    for split in ("train", "grpo", "eval"):
        run_step(f"convert-{split}", ["qwenvl-prep", "convert", str(raw / f"{split}.jsonl"), "-o",
                                      str(data / f"demo_{split}.json"), "--format", "video-span", "--from-yaml",
                                      str(sft_yaml), "-q"], logs)
    run_step("check", ["qwenvl-prep", "check", "--yaml", str(sft_yaml)], logs)
    evaluated: dict[str, Any] = {}

    def predict_and_eval(name: str, model_dir: Path | None) -> None:
        predictions = out / f"predictions-{name}.jsonl"
        if model_dir is not None:
            predict(name, model_dir, data / "demo_eval.json", predictions, logs, max_new_tokens=24, env=ONE_THREAD)
        run_step(f"eval-{name}", ["qwenvl-prep", "eval", str(data / "demo_eval.json"), "--predictions",
                                  str(predictions), "--json-out", str(out / f"eval-{name}.json")], logs)
        evaluated[name] = json.loads((out / f"eval-{name}.json").read_text())["spans"]

    write_jsonl(out / "predictions-baseline.jsonl", mean_span_predictions(train, held_out, raw))
    predict_and_eval("baseline", None)
    predict_and_eval("untrained", model)
    run_step("train-sft", ["llamafactory-cli", "train", str(sft_yaml)], logs, ONE_THREAD)
    grpo_yaml = write_yaml(out / "grpo.yaml", grpo_stage(common, out / "sft", out / "grpo", "demo_grpo", "tiou,format",
                                                         GRPO_STEPS if learning else GRPO_SMOKE_STEPS, 24))
    run_step("train-grpo", ["llamafactory-cli", "train", str(grpo_yaml)], logs, ONE_THREAD)
    export_full(out / "grpo", out / "exported", family, policy, sft_yaml, logs)
    predict_and_eval("trained", out / "exported")
    grpo_reward = [row["reward"] for row in load_jsonl(out / "grpo" / "trainer_log.jsonl") if "reward" in row]
    return {
        "task": "video", "family": family, "seed": seed, "sft_steps": steps, "train_clips": len(train),
        "held_out_clips": len(held_out), "video_policy": video.to_dict(),
        "held_out": {name: _headline(metrics) for name, metrics in evaluated.items()},
        "grpo_reward_first_last": [grpo_reward[0], grpo_reward[-1]],
        "sft_loss_first_last": [sft_loss[0], sft_loss[-1]] if (sft_loss := losses(out / "sft")) else None,
        "data": str(data), "exported": str(out / "exported"), "logs": str(logs),
    }


def _headline(spans: dict[str, Any]) -> dict[str, Any]:
    return {key: spans.get(key) for key in ("r1@0.3", "r1@0.5", "r1@0.7", "mean_tiou", "parse_failure_rate")}


def format_video_summary(summary: dict[str, Any]) -> str:
    """The held-out table a person reads at the end of the demo (the JSON summary goes to stdout)."""
    names = {"trained": "trained (SFT + GRPO)", "baseline": "mean-span baseline", "untrained": "untrained"}
    lines = [f"held-out clips: {summary['held_out_clips']} ({summary['family']}, {summary['sft_steps']} SFT steps)",
             f"{'':22}{'R@1 tIoU 0.5':>14}{'R@1 tIoU 0.7':>14}{'mean tIoU':>11}"]
    for key, name in names.items():
        m = summary["held_out"][key]
        cells = [f"{m[k]:.2f}" if isinstance(m.get(k), (int, float)) else "-" for k in ("r1@0.5", "r1@0.7")]
        tiou = f"{m['mean_tiou']:.3f}" if isinstance(m.get("mean_tiou"), (int, float)) else "-"
        lines.append(f"{name:22}{cells[0]:>14}{cells[1]:>14}{tiou:>11}")
    first, last = summary["grpo_reward_first_last"]
    lines.append(f"GRPO reward (tiou + format): first step {first:.3f}, last step {last:.3f}")
    return "\n".join(lines)
