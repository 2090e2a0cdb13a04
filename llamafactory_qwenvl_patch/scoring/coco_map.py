"""COCO-style mAP@[.5:.95] of many-box answers, which carry no confidence.

COCO's AP ranks detections by score. An answer's boxes have none, so every box ties, and a ranking-based AP then
depends on the order ties are broken in: pycocotools (and faster-coco-eval, its drop-in) give 1.0 or 0.667 for the
same answers depending on where one wrong box sits. ``map`` is therefore COCO's 101-point interpolated AP at the
single operating point equal scores define (precision P and recall R at each IoU threshold, per category: AP = P
times the share of the 101 recall points up to R, the expected AP over random tie orders), with one-to-one matching
as ``det_f1`` does. ``pycocotools_map`` is what pycocotools reports with every box scored 1 in answer and record
order, the number VLM detection papers usually print, for comparison with them.
"""

from __future__ import annotations

import contextlib
import io
from typing import Sequence

from llamafactory_qwenvl_patch.scoring.detection import Detection, label_key, matches_at

IOU_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
RECALL_POINTS = 101
ANY_LABEL = "object"  # the one category of class-agnostic data (a truth without labels)
PYCOCOTOOLS_MAX_BOXES = 500  # answers with more boxes get no pycocotools_map (its Python matching loop)

Image = tuple[Sequence[Detection], Sequence[Detection], tuple[float, float]]


def _categories(images: Sequence[Image]) -> tuple[bool, list[str]]:
    labelled = any(d.label for truth, _, _ in images for d in truth)
    names = {_category(d, labelled) for truth, predicted, _ in images for d in [*truth, *predicted]}
    return labelled, sorted(names)


def _category(detection: Detection, labelled: bool) -> str:
    return (label_key(detection.label) or "") if labelled else ANY_LABEL


def single_point_ap(matched: int, predicted: int, truth: int) -> float:
    """101-point interpolated AP of a precision-recall curve with one point (all detections tied)."""
    if not predicted or not matched:
        return 0.0
    recall = matched / truth
    points = sum(1 for i in range(RECALL_POINTS) if i / (RECALL_POINTS - 1) <= recall + 1e-12)
    return matched / predicted * points / RECALL_POINTS


def coco_map(images: Sequence[Image]) -> dict[str, float | None]:
    """``map``, ``ap50``, ``ap75`` (order-free, above) and ``pycocotools_map`` over ``(truth, predicted, (width,
    height))`` per image, boxes as corners in one frame. Label-aware when the truth has labels (a box of another
    label counts against that label's category, as in COCO), class-agnostic otherwise. None when no image has a truth
    box."""
    if not any(truth for truth, _, _ in images):
        return {"map": None, "ap50": None, "ap75": None, "pycocotools_map": None}
    labelled, names = _categories(images)
    per_threshold: dict[float, list[float]] = {t: [] for t in IOU_THRESHOLDS}
    for name in names:
        kept = [([d for d in truth if _category(d, labelled) == name],
                 [d for d in predicted if _category(d, labelled) == name]) for truth, predicted, _ in images]
        truth_count = sum(len(truth) for truth, _ in kept)
        if not truth_count:
            continue  # COCO averages over categories that have truth boxes
        predicted_count = sum(len(predicted) for _, predicted in kept)
        matched = {threshold: 0 for threshold in IOU_THRESHOLDS}
        for truth, predicted in kept:
            for threshold, pairs in matches_at(truth, predicted, IOU_THRESHOLDS).items():
                matched[threshold] += len(pairs)
        for threshold in IOU_THRESHOLDS:
            per_threshold[threshold].append(single_point_ap(matched[threshold], predicted_count, truth_count))
    mean = {t: sum(values) / len(values) for t, values in per_threshold.items()}
    return {"map": round(sum(mean.values()) / len(mean), 4), "ap50": round(mean[0.5], 4),
            "ap75": round(mean[0.75], 4), "pycocotools_map": _pycocotools_map(images, labelled, names)}


def _pycocotools_map(images: Sequence[Image], labelled: bool, names: list[str]) -> float | None:
    """pycocotools' mAP@[.5:.95] with every box scored 1, read from its precision array (its summary line assumes
    at most 100 boxes per image and reports -1 beyond). None when an answer has more than
    ``PYCOCOTOOLS_MAX_BOXES`` boxes: pycocotools matches box by box in Python (20 s for one answer of 3,000 boxes
    against 400), and ``map`` above, vectorised, stands for it."""
    if max(len(predicted) for _, predicted, _ in images) > PYCOCOTOOLS_MAX_BOXES:
        return None
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    ids = {name: i + 1 for i, name in enumerate(names)}
    gt = {"info": {}, "images": [], "annotations": [], "categories": [{"id": i, "name": n} for n, i in ids.items()]}
    predictions = []
    for image_id, (truth, predicted, (width, height)) in enumerate(images, start=1):
        gt["images"].append({"id": image_id, "width": width, "height": height})
        for d in truth:
            x1, y1, x2, y2 = d.box
            gt["annotations"].append({"id": len(gt["annotations"]) + 1, "image_id": image_id, "iscrowd": 0,
                                      "category_id": ids[_category(d, labelled)], "bbox": [x1, y1, x2 - x1, y2 - y1],
                                      "area": max(0.0, x2 - x1) * max(0.0, y2 - y1)})
        for d in predicted:
            x1, y1, x2, y2 = d.box
            predictions.append({"image_id": image_id, "category_id": ids[_category(d, labelled)], "score": 1.0,
                                "bbox": [x1, y1, x2 - x1, y2 - y1]})
    if not predictions:
        return 0.0
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools reports progress on stdout
        truth_api = COCO()
        truth_api.dataset = gt
        truth_api.createIndex()
        evaluator = COCOeval(truth_api, truth_api.loadRes(predictions), "bbox")
        evaluator.params.maxDets = [max(100, max(len(predicted) for _, predicted, _ in images))]
        evaluator.evaluate()
        evaluator.accumulate()
    precision = evaluator.eval["precision"][:, :, :, 0, -1]  # IoU x recall x category, area "all", most boxes
    valid = precision[precision > -1]
    return round(float(valid.mean()), 4) if valid.size else 0.0
