"""``qwenvl-prep eval``: predictions against a converted dataset, with every metric in original-image pixels.

Predictions are LLaMA-Factory's ``generated_predictions.jsonl`` (``do_predict`` + ``predict_with_generate``), joined
to the dataset by order and checked label by label, or the output of ``qwenvl-prep predict``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.metrics import IOU_THRESHOLD, Tally, score_grounding
from llamafactory_qwenvl_patch.policy import convert_coords
from llamafactory_qwenvl_patch.stamp import Stamp
from qwenvl_prep.atomic import atomic_writer
from qwenvl_prep.dataset import DatasetRef, iter_samples, load_jsonl
from qwenvl_prep.imageinfo import read_info

BUCKETS = ((0.5e6, "<0.5 MP"), (2e6, "0.5-2 MP"), (8e6, "2-8 MP"), (float("inf"), ">=8 MP"))


class AlignmentError(ValueError):
    """The predictions file does not line up with the dataset."""


def _norm(text: str) -> str:
    return " ".join(text.split())


def _bucket(width: int, height: int) -> str:
    return next(name for limit, name in BUCKETS if width * height < limit)


def _to_orig(coords, stamp: Stamp, hw: tuple[int, int], model_hw: tuple[int, int]) -> list[float]:
    return convert_coords(coords, stamp.coords, "orig", hw, model_hw, ndigits=None)


def _prediction_text(row: dict, index: int) -> str:
    for key in ("predict", "prediction"):
        if isinstance(row.get(key), str):
            return row[key]
    raise AlignmentError(f"predictions row {index} has no 'predict' text")


def evaluate(ref: DatasetRef, stamp: Stamp, predictions: Path) -> dict[str, Any]:
    """Acc@0.5 (IoU >= 0.5, one-to-one matching), mean IoU, parse failures and centre offset, overall and by size."""
    rows = load_jsonl(predictions)
    samples = list(iter_samples(ref))
    if len(rows) != len(samples):
        raise AlignmentError(f"{predictions} has {len(rows)} rows but {ref.path} has {len(samples)} records; "
                             "predictions must be in dataset order, one per record")
    overall, buckets = Tally(), {}
    for index, (row, sample) in enumerate(zip(rows, samples)):
        if sample.error or len(sample.images) != 1:
            raise AlignmentError(f"dataset record {index} cannot be evaluated: {sample.error or 'needs 1 image'}")
        if "label" in row and _norm(row["label"]) != _norm(sample.answer):
            raise AlignmentError(f"predictions row {index}: its label {row['label'][:80]!r} differs from dataset "
                                 f"record {index}'s answer {sample.answer[:80]!r}; the files are misaligned")
        if "image" in row and Path(row["image"]).resolve() != Path(sample.images[0]).resolve():
            raise AlignmentError(f"predictions row {index} is for {row['image']}, dataset record {index} for "
                                 f"{sample.images[0]}; the files are misaligned")
        info = read_info(sample.images[0])
        hw = info.hw
        model_hw = stamp.policy.model_size(*hw)

        truth = [_to_orig(item.coords, stamp, hw, model_hw) for item in sample.items if item.kind == "bbox_2d"]
        score = score_grounding(truth, _prediction_text(row, index),
                                lambda coords: _to_orig(coords, stamp, hw, model_hw))
        overall.add(score)
        buckets.setdefault(_bucket(info.width, info.height), Tally()).add(score)
    return {
        "dataset": str(ref.path),
        "predictions": str(predictions),
        "iou_threshold": f"IoU >= {IOU_THRESHOLD}",
        "overall": overall.to_dict(),
        "by_size": {name: buckets[name].to_dict() for _, name in BUCKETS if name in buckets},
    }


def format_table(result: dict[str, Any]) -> str:
    acc = f"acc@{IOU_THRESHOLD}"
    header = f"{'bucket':<10} {'samples':>7} {'boxes':>6} {'Acc@0.5':>8} {'mIoU':>7} {'parse fail':>10} {'offset px':>10}"
    lines = [f"Acc@0.5 counts a ground-truth box as found when its matched prediction has {result['iou_threshold']}",
             header]

    def fmt(value: Any, spec: str) -> str:
        return format(value, spec) if value is not None else "-"

    for name, row in [("overall", result["overall"]), *result["by_size"].items()]:
        lines.append(f"{name:<10} {row['samples']:>7} {row['truth_boxes']:>6} {fmt(row[acc], '8.3f')} "
                     f"{fmt(row['mean_iou'], '7.3f')} {fmt(row['parse_failure_rate'], '10.3f')} "
                     f"{fmt(row['mean_centre_offset_orig_px'], '10.1f')}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["by_size"])
    acc = [result["by_size"][n][f"acc@{IOU_THRESHOLD}"] or 0 for n in names]
    miou = [result["by_size"][n]["mean_iou"] or 0 for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], acc, 0.4, label="Acc@0.5")
    ax.bar([x + 0.2 for x in xs], miou, 0.4, label="mean IoU")
    ax.set_xticks(list(xs), names)
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("Grounding accuracy by original image size")
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
