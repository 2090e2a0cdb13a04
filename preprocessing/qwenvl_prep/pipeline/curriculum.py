"""``qwenvl-prep curriculum``: a low-to-high resolution curriculum as one converted dataset and one training YAML
per stage.

Qwen2.5-VL answers in absolute pixels of the resized image, so a stage that trains at another ``image_max_pixels``
needs its own labels: every stage's data is converted (and stamped) for that stage's frame, the stamp guard of
``qwenvl_patch`` accepts it only in that stage, and rewards compare in it. Each stage after the first resumes from
the previous stage's output (the LoRA adapter, or the full weights).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from qwenvl_prep.plumbing.atomic import atomic_writer
from qwenvl_prep.pipeline.convert import Abort, ConvertOptions, run_convert
from qwenvl_prep.pipeline.dataset_info import check_dataset_name
from qwenvl_prep.plumbing.outputs import Outputs
from qwenvl_prep.lf.run_spec import load_yaml, spec_from_yaml


class CurriculumError(ValueError):
    """Arguments that cannot make a curriculum."""


@dataclass
class CurriculumOptions:
    input: Path
    base_yaml: Path
    stages: list[int]  # image_max_pixels, low to high
    out: Path
    eval_input: Path | None = None
    input_coords: str | None = None
    fmt: str = "auto"
    image_dir: Path | None = None
    exif: str = "error"
    video_rotation: str = "error"
    workers: int = 1
    dataset_name: str | None = None
    overwrite: bool = False
    progress: bool = True


def parse_stages(text: str) -> list[int]:
    try:
        stages = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CurriculumError(f"--stages takes comma-separated integers (image_max_pixels), got {text!r}") from None
    if len(stages) < 2:
        raise CurriculumError("a curriculum needs at least 2 stages")
    if any(b <= a for a, b in zip(stages, stages[1:])):
        raise CurriculumError(f"--stages must rise from low to high resolution, got {stages}")
    return stages


def _stage_yaml(base: dict[str, Any], k: int, policy: ResizePolicy, dataset: str, eval_dataset: str | None,
                data_dir: Path, previous_output: str | None) -> dict[str, Any]:
    config = dict(base)
    output = str(Path(base.get("output_dir", "saves/curriculum")) / f"stage{k}")
    config.update(image_min_pixels=policy.min_pixels, image_max_pixels=policy.max_pixels, dataset=dataset,
                  dataset_dir=str(data_dir), output_dir=output)
    config.pop("eval_dataset", None)
    if eval_dataset:
        config["eval_dataset"] = eval_dataset
    if previous_output:
        if config.get("finetuning_type", "lora") == "lora":
            config["adapter_name_or_path"] = previous_output
        else:
            config["model_name_or_path"] = previous_output
    return config


def run_curriculum(opts: CurriculumOptions) -> dict[str, Any]:
    """Convert the data once per stage and write ``stage{k}.yaml``; returns the summary with the commands."""
    opts.out = Path(opts.out)
    if opts.out.exists() and not opts.out.is_dir():
        raise CurriculumError(f"-o {opts.out} is a file; the curriculum needs a folder (its stage YAMLs and data/)")
    name = opts.dataset_name or opts.input.stem
    check_dataset_name(name)  # it becomes file names inside -o and dataset names in the stage YAMLs
    base = load_yaml(opts.base_yaml)
    if base.get("eval_dataset") and opts.eval_input is None:
        raise CurriculumError(f"{opts.base_yaml} sets eval_dataset, whose labels are in one frame only: pass "
                              "--eval-input (converted per stage like the training data) or use val_size")
    spec = spec_from_yaml(opts.base_yaml)
    yaml_paths = [opts.out / f"stage{k}.yaml" for k in range(1, len(opts.stages) + 1)]
    existing = [str(p) for p in yaml_paths if p.exists()]
    if existing and not opts.overwrite:
        raise CurriculumError(f"{', '.join(existing)} already exist; pass --overwrite to replace them")
    guard = Outputs([opts.base_yaml, opts.input, *([opts.eval_input] if opts.eval_input else [])])
    for path in yaml_paths:
        guard.check(path, "stage YAML", inside=opts.out)
    data_dir = opts.out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    stages: list[dict[str, Any]] = []
    previous: str | None = None
    for k, max_pixels in enumerate(opts.stages, start=1):
        policy = ResizePolicy(min(spec.stamp.policy.min_pixels, max_pixels), max_pixels, spec.stamp.policy.factor)
        target = replace(spec.stamp, policy=policy)
        converted = {}
        for split, source in (("train", opts.input), ("eval", opts.eval_input)):
            if source is None:
                continue
            dataset = f"{name}_stage{k}" if split == "train" else f"{name}_eval_stage{k}"
            try:
                summary = run_convert(ConvertOptions(
                    input=Path(source), output=data_dir / f"{dataset}.jsonl", target=target,
                    input_coords=opts.input_coords, fmt=opts.fmt, image_dir=opts.image_dir,
                    exif=opts.exif, video_rotation=opts.video_rotation, workers=opts.workers, dataset_name=dataset,
                    progress=opts.progress, overwrite=opts.overwrite))
            except Abort as abort:
                raise CurriculumError(f"stage {k}: {abort.summary['dropped']} bad record(s) in {source}, nothing "
                                      f"written for this stage; see {abort.summary['error_report']}") from None
            converted[split] = (dataset, summary)
        config = _stage_yaml(base, k, policy, converted["train"][0], converted.get("eval", (None,))[0],
                             data_dir.resolve(), previous)
        with atomic_writer(yaml_paths[k - 1]) as f:
            f.write(yaml.safe_dump(config, sort_keys=False))
        stages.append({"stage": k, "yaml": str(yaml_paths[k - 1]), "image_min_pixels": policy.min_pixels,
                       "image_max_pixels": policy.max_pixels, "dataset": converted["train"][0],
                       "records": converted["train"][1]["written"], "output_dir": config["output_dir"],
                       "resumes_from": previous})
        previous = config["output_dir"]
    return {"stages": stages,
            "run": " && ".join(f"llamafactory-cli train {p}" for p in yaml_paths)}
