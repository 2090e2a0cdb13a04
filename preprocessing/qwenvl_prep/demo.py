"""``qwenvl-prep demo OUT``: the whole pipeline on CPU in a few minutes, on data and a model it makes itself.

Synthesise drawn shapes with known boxes (mixed sizes, 4032x3024 included) -> convert -> check -> tiny model ->
``llamafactory-cli train`` (SFT, LoRA; and GRPO with iou + format rewards) -> ``llamafactory-cli export`` ->
predict -> eval -> draw.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import yaml

from qwenvl_prep.dataset import load_jsonl

SIZES = [(4032, 3024), (3024, 4032), (1920, 1080), (1170, 2532), (640, 480), (800, 600), (2480, 3508), (1280, 720),
         (1024, 1024), (500, 375), (2560, 1440), (3000, 2000)]
SHAPES = ("rectangle", "ellipse")
COLORS = {"red": (40, 40, 220), "green": (60, 180, 60), "blue": (220, 90, 40), "yellow": (40, 220, 230)}
MIN_PIXELS, MAX_PIXELS = 128 * 28 * 28, 512 * 28 * 28


def synthesise(folder: Path, seed: int = 0) -> list[dict[str, Any]]:
    """One shape per image, labelled in original pixels as plain {image, question, answer} records."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i, (w, h) in enumerate(SIZES):
        canvas = np.full((h, w, 3), rng.randint(200, 250), np.uint8)
        bw, bh = rng.randint(w // 8, w // 3), rng.randint(h // 8, h // 3)
        x1, y1 = rng.randint(0, w - bw), rng.randint(0, h - bh)
        shape, (color, bgr) = rng.choice(SHAPES), rng.choice(list(COLORS.items()))
        if shape == "rectangle":
            cv2.rectangle(canvas, (x1, y1), (x1 + bw - 1, y1 + bh - 1), bgr, -1)
        else:
            cv2.ellipse(canvas, (x1 + bw // 2, y1 + bh // 2), (bw // 2, bh // 2), 0, 0, 360, bgr, -1)
        name = f"shape{i:02d}_{w}x{h}.jpg"
        cv2.imwrite(str(folder / name), canvas, [cv2.IMWRITE_JPEG_QUALITY, 85])
        label = f"{color} {shape}"
        records.append({"image": name, "question": f"Locate the {label} and output its bbox_2d in JSON.",
                        "answer": json.dumps([{"bbox_2d": [x1, y1, x1 + bw, y1 + bh], "label": label}])})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_step(step: str, args: list[str], log_dir: Path) -> None:
    """Run one step as its own process (as a user would), logging to a file; fail with the log's tail."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
           "DISABLE_VERSION_CHECK": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = log_dir / f"{step}.log"
    print(f"[demo] {step}: {' '.join(args)} (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        code = subprocess.run([str(bin_dir / args[0]), *args[1:]], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"demo step {step} failed (exit {code}); end of {log}:\n{tail}")


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_demo(out: Path, steps: int = 4, task: str = "grounding") -> dict[str, Any]:
    """The grounding demo, or with ``task="fields"`` the field-extraction one (``demo_fields``)."""
    if task == "fields":
        from qwenvl_prep.demo_fields import run_fields_demo

        return run_fields_demo(out, steps)
    if task != "grounding":
        raise ValueError(f"demo task must be grounding or fields, got {task!r}")
    out = out.resolve()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder")
    logs, data = out / "logs", out / "data"
    logs.mkdir(parents=True)
    records = synthesise(out / "raw")
    write_jsonl(out / "raw" / "train.jsonl", records)
    write_jsonl(out / "raw" / "eval.jsonl", records[:6])
    run_step("tiny-model", ["qwenvl-prep", "tiny-model", str(out / "model")], logs)
    common = {"model_name_or_path": str(out / "model"), "template": "qwen2_vl", "qwenvl_patch": True,
              "image_min_pixels": MIN_PIXELS, "image_max_pixels": MAX_PIXELS}
    sft_yaml = write_yaml(out / "sft.yaml", {
        **common, "stage": "sft", "do_train": True, "finetuning_type": "lora", "lora_target": "all",
        "dataset": "demo_train", "dataset_dir": str(data), "cutoff_len": 1024, "overwrite_cache": True,
        "preprocessing_num_workers": 1, "output_dir": str(out / "sft"), "logging_steps": 1, "save_steps": steps,
        "max_steps": steps, "per_device_train_batch_size": 2, "learning_rate": 5.0e-4, "report_to": "none",
        "use_cpu": True, "plot_loss": True,
    })
    for split in ("train", "eval"):
        run_step(f"convert-{split}", ["qwenvl-prep", "convert", str(out / "raw" / f"{split}.jsonl"), "-o",
                                  str(data / f"demo_{split}.json"), "--from-yaml", str(sft_yaml), "--input-coords",
                                  "abs", "-q"], logs)
    run_step("check", ["qwenvl-prep", "check", "--yaml", str(sft_yaml), "--decode"], logs)
    run_step("train-sft", ["llamafactory-cli", "train", str(sft_yaml)], logs)
    grpo_yaml = write_yaml(out / "grpo.yaml", {
        **common, "stage": "grpo", "do_train": True, "finetuning_type": "lora", "lora_target": "all",
        "reward_funcs": "iou,format", "grpo_num_generations": 4, "temperature": 1.0, "max_new_tokens": 24,
        "dataset": "demo_train", "dataset_dir": str(data), "cutoff_len": 1024, "preprocessing_num_workers": 1,
        "output_dir": str(out / "grpo"), "logging_steps": 1, "save_steps": 2, "max_steps": 2,
        "per_device_train_batch_size": 1, "learning_rate": 1.0e-4, "report_to": "none", "use_cpu": True,
        "grpo_log_completions": True,
    })
    run_step("train-grpo", ["llamafactory-cli", "train", str(grpo_yaml)], logs)
    export_yaml = write_yaml(out / "export.yaml", {
        **common, "adapter_name_or_path": str(out / "sft"), "finetuning_type": "lora",
        "export_dir": str(out / "exported"), "export_size": 1, "export_device": "cpu",
    })
    run_step("export", ["llamafactory-cli", "export", str(export_yaml)], logs)
    run_step("fix-config", ["qwenvl-prep", "fix-config", str(out / "exported"), "--yaml", str(sft_yaml)], logs)
    predictions = out / "predictions.jsonl"
    run_step("predict", ["qwenvl-prep", "predict", str(out / "exported"), "--dataset", str(data / "demo_eval.json"),
                     "-o", str(predictions), "--max-new-tokens", "48"], logs)
    run_step("eval", ["qwenvl-prep", "eval", str(data / "demo_eval.json"), "--predictions", str(predictions),
                  "--json-out", str(out / "eval.json"), "--plot", str(out / "eval.png")], logs)
    run_step("draw", ["qwenvl-prep", "draw", str(data / "demo_eval.json"), "-o", str(out / "drawn"), "--sample", "0",
                  "--predictions", str(predictions)], logs)
    summary = {
        "data": str(data), "model": str(out / "model"), "sft_checkpoint": str(out / "sft"),
        "exported": str(out / "exported"), "predictions": str(predictions), "eval": str(out / "eval.json"),
        "drawn": str(out / "drawn"), "logs": str(logs),
        "metrics": json.loads((out / "eval.json").read_text())["overall"],
        "sft_loss": [row["loss"] for row in load_jsonl(out / "sft" / "trainer_log.jsonl") if "loss" in row],
        "grpo_checkpoint": str(out / "grpo"),
        "grpo_reward": [row["reward"] for row in load_jsonl(out / "grpo" / "trainer_log.jsonl") if "loss" in row],
    }
    return summary
