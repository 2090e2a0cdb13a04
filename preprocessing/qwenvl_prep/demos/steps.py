"""What every demo does between its own steps: run one step as its own process (as a user would), write its
inputs, and the steps the demos share (a new run folder, the small model, full training from scratch on CPU, export,
predict). The demos (``grounding``, ``fields`` for invoices, ``gui`` for clicks) import this;
``grounding.run_demo`` also dispatches to the other two, which never import each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record
from qwenvl_prep.formats.converted import load_jsonl
from qwenvl_prep.plumbing.outputs import require_new_folder


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# The GUI demo's SFT and the fields demo's training and predictions run torch on one thread: their numbers are then
# the same whatever the machine's core count (the fields demo's GRPO-vs-SFT comparison came out otherwise with
# torch's default two threads on two cores), and a dataloader worker has the other core. With two threads beside
# that worker and one other busy process, a step of the GUI demo took 6 s instead of 0.4 s.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def run_step(step: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
             stdout: Path | None = None) -> None:
    """Run one step as its own process (as a user would), logging to a file; fail with the log's tail. ``env`` adds
    variables the user has not set; ``stdout`` keeps the step's standard output apart from its log (a JSON summary
    the demo reads)."""
    bin_dir = Path(sys.executable).parent
    env = {**(env or {}), **os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "DISABLE_VERSION_CHECK": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = log_dir / f"{step}.log"
    print(f"[demo {time.strftime('%H:%M:%S')}] {step}: {' '.join(args)} (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as f, open(stdout or os.devnull, "w") as out:
        code = subprocess.run([str(bin_dir / args[0]), *args[1:]], stdout=out if stdout else f,
                              stderr=subprocess.STDOUT if stdout is None else f, env=env).returncode
    if code != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"demo step {step} failed (exit {code}); end of {log}:\n{tail}")


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def steps_for(minutes: float, steps_per_minute: float) -> int:
    """SFT steps for a training budget in minutes of 2 CPU cores (a demo's measured rate): a fixed count, so a run
    is reproducible."""
    return max(1, round(minutes * steps_per_minute))


def new_run_folder(out: Path) -> tuple[Path, Path]:
    """The run's folder, refused when it holds anything (a demo never writes over files), and its ``logs/``."""
    out = out.resolve()
    require_new_folder(out)
    (out / "logs").mkdir(parents=True)
    return out, out / "logs"


def small_model(folder: Path, family: str, policy: ResizePolicy, logs: Path, seed: int = 0) -> Path:
    """The ~1M-parameter random-weight model (``tiny-model --size small``, its weights drawn with ``seed``), pinned
    to the run's frame so that the untrained model answers in it too."""
    run_step("tiny-model", ["qwenvl-prep", "tiny-model", str(folder), "--family", family, "--size", "small",
                            "--seed", str(seed)], logs)
    write_policy_record(folder, policy)
    return folder


def full_training(family: str, data: Path, dataset: str, policy: ResizePolicy) -> dict[str, Any]:
    """The keys every demo stage shares when it trains the small model from scratch on CPU: full fine-tuning with
    the vision tower and projector unfrozen, in the run's pinned frame."""
    return {"template": FAMILIES[family].default_template, "qwenvl_patch": True,
            "image_min_pixels": policy.min_pixels, "image_max_pixels": policy.max_pixels, "dataset": dataset,
            "dataset_dir": str(data), "cutoff_len": 512, "preprocessing_num_workers": 2, "finetuning_type": "full",
            "freeze_vision_tower": False, "freeze_multi_modal_projector": False, "do_train": True,
            "report_to": "none", "use_cpu": True, "save_only_model": True}


def convert_and_check(sources: dict[str, Path], data: Path, prefix: str, train_yaml: Path, options: list[str],
                      logs: Path) -> dict[str, Path]:
    """``qwenvl-prep convert`` each split into the training YAML's frame (``data/<prefix>_<split>.json``, registered
    in ``dataset_info.json``), then ``check --decode`` the YAML's datasets; returns the converted files."""
    converted = {}
    for split, source in sources.items():
        converted[split] = data / f"{prefix}_{split}.json"
        run_step(f"convert-{split}", ["qwenvl-prep", "convert", str(source), "-o", str(converted[split]),
                                      "--from-yaml", str(train_yaml), *options, "-q"], logs)
    run_step("check", ["qwenvl-prep", "check", "--yaml", str(train_yaml), "--decode"], logs)
    return converted


# the demos' SFT draws each image 6 to 9 times (batch 8 over a few hundred to 1,200 images): their model-input images
# (at most 64 x 28 x 28 pixels, 150 KB each) are kept in the process that collates (LF's default: the main one)
SFT_IMAGE_CACHE_MB = 512


def sft_stage(common: dict[str, Any], model: Path, output: Path, steps: int, batch: int) -> dict[str, Any]:
    """SFT from scratch at a fixed step count: lr 2e-3 with a cosine schedule (a random-weight model learns
    positions within minutes at this rate), each image decoded and resized once (``qwenvl_image_cache_mb``)."""
    return {**common, "model_name_or_path": str(model), "stage": "sft", "overwrite_cache": True,
            "qwenvl_image_cache_mb": SFT_IMAGE_CACHE_MB,
            "output_dir": str(output), "logging_steps": max(1, steps // 20), "max_steps": steps,
            "save_strategy": "no", "per_device_train_batch_size": batch, "learning_rate": 2.0e-3,
            "lr_scheduler_type": "cosine", "warmup_ratio": 0.05, "plot_loss": True}


def grpo_stage(common: dict[str, Any], start: Path, output: Path, dataset: str, reward_funcs: str, steps: int,
               max_new_tokens: int) -> dict[str, Any]:
    """A few GRPO steps from the SFT model: 4 prompts a step, 4 completions each at temperature 1, every
    completion logged."""
    return {**common, "model_name_or_path": str(start), "stage": "grpo", "dataset": dataset,
            "reward_funcs": reward_funcs, "grpo_num_generations": 4, "temperature": 1.0,
            "max_new_tokens": max_new_tokens, "output_dir": str(output), "logging_steps": 1, "save_strategy": "no",
            "max_steps": steps, "per_device_train_batch_size": 4, "learning_rate": 1.0e-5,
            "grpo_log_completions": True}


def export_full(trained: Path, export_dir: Path, family: str, policy: ResizePolicy, train_yaml: Path,
                logs: Path) -> Path:
    """``llamafactory-cli export`` of a fully trained model, then ``fix-config`` against the training YAML."""
    export_yaml = write_yaml(export_dir.parent / "export.yaml", {
        "model_name_or_path": str(trained), "template": FAMILIES[family].default_template, "qwenvl_patch": True,
        "image_min_pixels": policy.min_pixels, "image_max_pixels": policy.max_pixels, "finetuning_type": "full",
        "export_dir": str(export_dir), "export_size": 1, "export_device": "cpu",
    })
    run_step("export", ["llamafactory-cli", "export", str(export_yaml)], logs)
    run_step("fix-config", ["qwenvl-prep", "fix-config", str(export_dir), "--yaml", str(train_yaml)], logs)
    return export_dir


def predict(name: str, model_dir: Path, dataset: Path, predictions: Path, logs: Path, max_new_tokens: int = 64,
            temperature: float = 0.0, seed: int = 0, env: dict[str, str] | None = None) -> Path:
    """``qwenvl-prep predict`` over a converted dataset (answers mapped back to original pixels): greedy, or sampled
    at ``temperature`` from ``seed``."""
    sampling = ["--temperature", str(temperature), "--seed", str(seed)] if temperature else []
    run_step(f"predict-{name}", ["qwenvl-prep", "predict", str(model_dir), "--dataset", str(dataset), "-o",
                                 str(predictions), "--max-new-tokens", str(max_new_tokens), *sampling], logs, env)
    return predictions


def losses(folder: Path) -> list[float]:
    """The training losses a stage logged (``trainer_log.jsonl``)."""
    return [row["loss"] for row in load_jsonl(folder / "trainer_log.jsonl") if "loss" in row]
