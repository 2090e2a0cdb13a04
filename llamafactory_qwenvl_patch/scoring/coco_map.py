"""COCO-style mAP@[.5:.95] of many-box answers through pycocotools, the reference implementation every detection
paper reports (faster-coco-eval gives the same numbers faster, which only matters far beyond eval-set sizes).

Answers carry no confidence, so every predicted box scores 1: the precision-recall curve has one operating point
per image set, and mAP measures how many boxes are right at each IoU threshold, not a ranking.
"""

from __future__ import annotations

import contextlib
import io
from typing import Sequence

from llamafactory_qwenvl_patch.scoring.detection import Detection

ANY_LABEL = "object"  # the one category of class-agnostic data (a truth without labels)


def _category(detection: Detection, labelled: bool) -> str:
    return " ".join(detection.label.casefold().split()) if labelled and detection.label else ANY_LABEL


def coco_map(images: Sequence[tuple[Sequence[Detection], Sequence[Detection], tuple[float, float]]]
             ) -> dict[str, float | None]:
    """``{"map", "ap50", "ap75"}`` over ``(truth, predicted, (width, height))`` per image, boxes as corners in one
    frame. Label-aware when the truth has labels (a box of another label is a false positive of that label),
    class-agnostic otherwise. None when no image has a truth box."""
    labelled = any(d.label for truth, _, _ in images for d in truth)
    names = sorted({_category(d, labelled) for truth, predicted, _ in images for d in [*truth, *predicted]})
    if not any(truth for truth, _, _ in images):
        return {"map": None, "ap50": None, "ap75": None}
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
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools reports progress on stdout
        truth_api = COCO()
        truth_api.dataset = gt
        truth_api.createIndex()
        if not predictions:
            return {"map": 0.0, "ap50": 0.0, "ap75": 0.0}
        evaluator = COCOeval(truth_api, truth_api.loadRes(predictions), "bbox")
        most = max(len(predicted) for _, predicted, _ in images)
        evaluator.params.maxDets = [1, 10, max(100, most)]
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = evaluator.stats
    return {key: round(max(float(value), 0.0), 4) for key, value in zip(("map", "ap50", "ap75"), stats[:3])}
