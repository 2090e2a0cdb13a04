"""Every grounding metric of one eval pass, in original-image pixels, shared by ``qwenvl-prep eval`` and GRPO's
evaluation so that both report the same numbers: Acc@0.5 / mean IoU (``metrics.Tally``), click accuracy, detection
precision / recall / F1 at IoU 0.5 with COCO mAP, the detection-hack monitors, and how "not present" records (answer
``[]``) were answered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from llamafactory_qwenvl_patch.scoring.answers import Item, not_present, try_parse_items
from llamafactory_qwenvl_patch.scoring.clicks import click_dense_score, click_hit, click_point, truth_box
from llamafactory_qwenvl_patch.scoring.coco_map import coco_map
from llamafactory_qwenvl_patch.scoring.detection import Detection, MonitorTally, match_detections
from llamafactory_qwenvl_patch.scoring.metrics import IOU_THRESHOLD, AbsentTally, Tally, _ratio, iou, score_grounding

ToOrig = Callable[[Sequence[float]], list[float]]


@dataclass
class ClickTally:
    """Clicks against truth boxes: accuracy (point in box), mean ``click_dense`` and answers with no click; for
    records whose label is a box (RefCOCO), the referring-expression accuracy as it is published: the answer's first
    box at IoU >= 0.5 with the truth box (``Tally``'s Acc@0.5 matches every answered box one to one, so an answer
    listing several boxes scores there when any of them fits)."""

    samples: int = 0
    hits: int = 0
    dense: float = 0.0
    no_click: int = 0
    first_box_samples: int = 0
    first_box_hits: int = 0

    def add(self, point: tuple[float, float] | None, box: Sequence[float]) -> None:
        self.samples += 1
        if point is None:
            self.no_click += 1
            return
        self.hits += click_hit(point, box)
        self.dense += click_dense_score(point, box)

    def add_first_box(self, box: Sequence[float] | None, truth: Sequence[float]) -> None:
        """A box-labelled record: ``box`` is the answer's first box in the truth's pixels (None: it has none)."""
        self.first_box_samples += 1
        self.first_box_hits += box is not None and iou(box, truth) >= IOU_THRESHOLD

    def to_dict(self) -> dict[str, Any]:
        out = {"samples": self.samples, "click_acc": _ratio(self.hits, self.samples),
               "click_dense_mean": _ratio(self.dense, self.samples),
               "no_click_rate": _ratio(self.no_click, self.samples)}
        if self.first_box_samples:
            out.update({"first_box_samples": self.first_box_samples,
                        "first_box_acc@0.5": _ratio(self.first_box_hits, self.first_box_samples)})
        return out


@dataclass
class DetectionTally:
    """Box counts behind precision / recall / F1 at IoU 0.5 (label-aware, summed over images) and the boxes that
    COCO mAP needs."""

    matched: int = 0
    predicted: int = 0
    truth: int = 0
    images: list[tuple[list[Detection], list[Detection], tuple[float, float]]] = field(default_factory=list)

    def add(self, truth: list[Detection], predicted: list[Detection], size: tuple[float, float]) -> None:
        self.matched += len(match_detections(truth, predicted))
        self.predicted += len(predicted)
        self.truth += len(truth)
        self.images.append((truth, predicted, size))

    def to_dict(self) -> dict[str, Any]:
        precision, recall = _ratio(self.matched, self.predicted), _ratio(self.matched, self.truth)
        f1 = _ratio(2 * self.matched, self.predicted + self.truth)
        return {"images": len(self.images), "truth_boxes": self.truth, "predicted_boxes": self.predicted,
                "precision@0.5": precision, "recall@0.5": recall, "f1@0.5": f1, **coco_map(self.images)}


def is_grounding(items: Sequence[Item], reference: str, meta: Any) -> bool:
    """A record scored by ``GroundingEval``: reference boxes or points, a "not present" answer, or a truth box in
    ``meta``."""
    return bool(items) or not_present(reference) or truth_box("", meta, list) is not None


def _detections(items: Sequence[Item], to_orig: ToOrig) -> list[Detection]:
    return [Detection(tuple(to_orig(item.coords)), item.label) for item in items if item.kind == "bbox_2d"]


@dataclass
class GroundingEval:
    """One pass over (reference, answer) pairs. ``detection`` off keeps a subset's tally light (no boxes kept)."""

    detection_on: bool = True
    boxes: Tally = field(default_factory=Tally)
    clicks: ClickTally = field(default_factory=ClickTally)
    detection: DetectionTally = field(default_factory=DetectionTally)
    monitors: MonitorTally = field(default_factory=MonitorTally)
    absent: AbsentTally = field(default_factory=AbsentTally)

    def add(self, reference: Sequence[Item], answer: str, meta: Any, to_orig: ToOrig,
            orig_size: tuple[float, float]) -> None:
        """``reference``: the record's items in the model frame (empty for a "not present" record, whose right
        answer has no box); ``to_orig`` maps the model frame to original pixels; ``orig_size`` is (width, height).
        A record with a truth box in ``meta`` is a click sample; a record with reference boxes is a box sample
        (RefCOCO answered with boxes is both)."""
        box = truth_box("", meta, list)
        predicted = try_parse_items(answer)
        if box is not None:
            point = click_point(answer)
            self.clicks.add(tuple(to_orig(point)) if point is not None else None, box)
            if any(item.kind == "bbox_2d" for item in reference):
                first = next((item for item in predicted or [] if item.kind == "bbox_2d"), None)
                self.clicks.add_first_box(to_orig(first.coords) if first is not None else None, box)
        truth = _detections(reference, to_orig)
        found = _detections(predicted, to_orig) if predicted is not None else None
        if truth:
            self.boxes.add(score_grounding([d.box for d in truth], answer, to_orig))
            self.monitors.add(truth, found, orig_size)
        if not reference and box is None:
            self.absent.add(answer)
        if self.detection_on and (truth or not reference):
            self.detection.add(truth, found or [], orig_size)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.boxes.truth_boxes:
            out["boxes"] = self.boxes.to_dict()
        if self.clicks.samples:
            out["clicks"] = self.clicks.to_dict()
        if self.detection_on and self.detection.images:
            out["detection"] = self.detection.to_dict()
        if self.monitors.answers:
            out["monitors"] = self.monitors.to_dict()
        if self.absent.samples:
            out["not_present"] = self.absent.to_dict()
        return out
