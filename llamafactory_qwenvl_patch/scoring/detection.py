"""Many-box detection (pure functions): one-to-one matching at IoU 0.5 (label-aware), F1, the known reward hacks
of detection GRPO (whole-image boxes, box flooding, duplicates) and the cheap monitors that show them.

Boxes and the frame extent are in one frame, whatever it is (model pixels, 0-1000, or original pixels).
"""

from __future__ import annotations

import statistics
import unicodedata
from dataclasses import dataclass
from typing import Any, Sequence

from llamafactory_qwenvl_patch.scoring.answers import try_parse_items
from llamafactory_qwenvl_patch.scoring.metrics import IOU_THRESHOLD, iou_matrix

WHOLE_IMAGE_SHARE = 0.8  # a box covering this share of the frame answers "everything"
WHOLE_IMAGE_TRUTH = 0.5  # ... which is a hack only when no truth box covers even this share
DUPLICATE_IOU = 0.9  # two predicted boxes this alike (same label) are one object named twice
DUPLICATE_BLOCK = 512  # rows of the IoU matrix held at once when counting duplicates
HACKS = ("whole_image", "too_many", "duplicates")


@dataclass(frozen=True)
class Detection:
    box: tuple[float, ...]
    label: str | None = None


def detections(text: str) -> list[Detection] | None:
    """The boxes of an answer with their labels; None when its coordinates are malformed."""
    items = try_parse_items(text)
    if items is None:
        return None
    return [Detection(item.coords, item.label) for item in items if item.kind == "bbox_2d"]


def label_key(label: str | None) -> str | None:
    """A label as matching and mAP compare it: Unicode width folded (NFKC), case folded, whitespace collapsed."""
    return None if label is None else " ".join(unicodedata.normalize("NFKC", label).casefold().split())


def _label_mask(truth: Sequence[Detection], predicted: Sequence[Detection]) -> Any:
    """(T, P) bool: which predictions may match which truth box by label. A truth without a label matches any box
    (class-agnostic data); a labelled truth needs the same label (``label_key``), so leaving labels out never
    matches more than naming them."""
    import numpy as np

    keys = {label_key(d.label) for d in predicted}
    codes = {key: i for i, key in enumerate(sorted(keys, key=str))}
    guess = np.array([codes[label_key(d.label)] for d in predicted])
    rows = [np.ones(len(predicted), dtype=bool) if t.label is None else
            (guess == codes[label_key(t.label)] if label_key(t.label) in codes else np.zeros(len(predicted), bool))
            for t in truth]
    return np.stack(rows)


def matches_at(truth: Sequence[Detection], predicted: Sequence[Detection], thresholds: Sequence[float]
                 ) -> dict[float, list[tuple[int, int, float]]]:
    """``match_detections`` at each of ``thresholds``, the IoUs computed once (COCO's ten thresholds)."""
    if not truth or not predicted:
        return {threshold: [] for threshold in thresholds}
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    ious = iou_matrix([d.box for d in truth], [d.box for d in predicted])
    allowed = _label_mask(truth, predicted)
    out = {}
    for threshold in thresholds:
        weights = np.where((ious >= threshold) & allowed, 1.0 + ious, 0.0)
        rows, cols = linear_sum_assignment(weights, maximize=True)
        out[threshold] = [(int(r), int(c), float(ious[r, c])) for r, c in zip(rows, cols) if weights[r, c] > 0]
    return out


def match_detections(truth: Sequence[Detection], predicted: Sequence[Detection],
                     threshold: float = IOU_THRESHOLD) -> list[tuple[int, int, float]]:
    """One-to-one matches (truth index, prediction index, IoU) with IoU >= ``threshold`` and agreeing labels: the
    most matches possible, and among those the highest total IoU (Hungarian on 1 + IoU). Independent of the order of
    either list."""
    return matches_at(truth, predicted, [threshold])[threshold]


def f1_score(matched: int, predicted: int, truth: int) -> float:
    """F1 of one answer; 1 when both the truth and the answer are empty (a correct "nothing here")."""
    if not predicted and not truth:
        return 1.0
    return 2 * matched / (predicted + truth)


def detection_f1(truth: Sequence[Detection], predicted: Sequence[Detection]) -> float:
    return f1_score(len(match_detections(truth, predicted)), len(predicted), len(truth))


def _area(box: Sequence[float]) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def hacks(truth: Sequence[Detection], predicted: Sequence[Detection], extent: tuple[float, float]) -> list[str]:
    """The known detection hacks an answer shows, in ``HACKS`` order: ``whole_image`` (a box over most of the frame
    when no truth box is that large), ``too_many`` (more than twice the truth's boxes and more than 3 extra) and
    ``duplicates`` (more pairs of one label with IoU >= 0.9 than the truth has)."""
    frame = extent[0] * extent[1]
    found = []
    largest_truth = max((_area(d.box) for d in truth), default=0.0)
    if frame > 0 and largest_truth < WHOLE_IMAGE_TRUTH * frame and any(
            _area(d.box) >= WHOLE_IMAGE_SHARE * frame for d in predicted):
        found.append("whole_image")
    if len(predicted) > max(2 * len(truth), len(truth) + 3):
        found.append("too_many")
    if _duplicate_pairs(predicted) > _duplicate_pairs(truth):
        found.append("duplicates")
    return found


def _duplicate_pairs(boxes: Sequence[Detection]) -> int:
    """Pairs of boxes of one label (or unlabelled) with IoU >= 0.9: in the truth these are real overlapping objects,
    so an answer is flagged only for pairs beyond the truth's own. Counted by blocks of rows of the IoU matrix, so
    20,000 boxes take seconds and bounded memory."""
    import numpy as np

    groups: dict[str | None, list[tuple[float, ...]]] = {}
    for box in boxes:
        groups.setdefault(label_key(box.label), []).append(box.box)
    pairs = 0
    for members in groups.values():
        for start in range(0, len(members), DUPLICATE_BLOCK):
            block = iou_matrix(members[start:start + DUPLICATE_BLOCK], members)
            upper = np.arange(len(members))[None, :] > np.arange(start, start + len(block))[:, None]
            pairs += int(np.count_nonzero((block >= DUPLICATE_IOU) & upper))
    return pairs


def sanity_penalty(truth: Sequence[Detection], predicted: Sequence[Detection], extent: tuple[float, float]) -> float:
    """-1/3 per hack shown, so -1 with all three; 0 for an honest answer."""
    return -len(hacks(truth, predicted, extent)) / len(HACKS)


@dataclass
class MonitorTally:
    """Running counts behind the detection monitors of one batch or one eval: rates of whole-image boxes, empty
    answers (no box where the truth has boxes) and duplicates, the median predicted/true mean-box-area ratio and the
    predicted/true box count ratio."""

    answers: int = 0
    whole_image: int = 0
    empty: int = 0
    duplicates: int = 0
    predicted_boxes: int = 0
    truth_boxes: int = 0
    area_ratios: list[float] | None = None

    def add(self, truth: Sequence[Detection], predicted: Sequence[Detection] | None,
            extent: tuple[float, float]) -> None:
        """One answer (None: malformed, counted as an answer with no boxes) against a non-empty truth."""
        predicted = predicted or []
        found = hacks(truth, predicted, extent)
        self.answers += 1
        self.whole_image += "whole_image" in found
        self.duplicates += "duplicates" in found
        self.empty += not predicted
        self.predicted_boxes += len(predicted)
        self.truth_boxes += len(truth)
        if predicted and truth:
            mean_predicted = sum(_area(d.box) for d in predicted) / len(predicted)
            mean_truth = sum(_area(d.box) for d in truth) / len(truth)
            if mean_truth > 0:
                self.area_ratios = (self.area_ratios or []) + [mean_predicted / mean_truth]

    def merge(self, other: "MonitorTally") -> None:
        """Add another tally's counts (another rank's, or another rollout's): rates stay exact, not means of means."""
        for name in ("answers", "whole_image", "empty", "duplicates", "predicted_boxes", "truth_boxes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.area_ratios:
            self.area_ratios = (self.area_ratios or []) + other.area_ratios

    def to_dict(self) -> dict[str, float | None]:
        n = self.answers
        return {
            "whole_image_rate": self.whole_image / n if n else None,
            "empty_answer_rate": self.empty / n if n else None,
            "duplicate_rate": self.duplicates / n if n else None,
            "area_ratio_median": statistics.median(self.area_ratios) if self.area_ratios else None,
            "count_ratio": self.predicted_boxes / self.truth_boxes if self.truth_boxes else None,
        }
