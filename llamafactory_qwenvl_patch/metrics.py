"""Box geometry for evaluation and rewards (pure): IoU, one-to-one matching, centre offsets."""

from __future__ import annotations

import math
from typing import Sequence

Box = Sequence[float]


def iou(a: Box, b: Box) -> float:
    """Intersection over union of two [x1, y1, x2, y2] boxes, in [0, 1]; 0 for degenerate boxes."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    area_a = max(0.0, a[2] - a[0]) * max(0.0, a[3] - a[1])
    area_b = max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1])
    union = area_a + area_b - inter
    return inter / union if union > 0 else 0.0


def match_boxes(truth: Sequence[Box], predicted: Sequence[Box]) -> list[tuple[int, int, float]]:
    """One-to-one matching that maximises total IoU (Hungarian); returns (truth index, prediction index, IoU)
    for matched pairs with IoU > 0. Independent of the order of either list."""
    if not truth or not predicted:
        return []
    from scipy.optimize import linear_sum_assignment

    scores = [[iou(t, p) for p in predicted] for t in truth]
    rows, cols = linear_sum_assignment(scores, maximize=True)
    return [(int(r), int(c), scores[r][c]) for r, c in zip(rows, cols) if scores[r][c] > 0]


def centre_offset(a: Box, b: Box) -> float:
    """Euclidean distance between box centres."""
    return math.hypot((a[0] + a[2] - b[0] - b[2]) / 2, (a[1] + a[3] - b[1] - b[3]) / 2)
