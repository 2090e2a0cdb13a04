"""Click grounding (GUI agents): the point an answer clicks, scored against the truth box (pure functions).

Every function works in one frame, whatever it is: the caller passes the point and the box in the same units
(Qwen2.5-VL model pixels, 0-1000 for Qwen2-VL and Qwen3-VL, or original pixels in eval).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from llamafactory_qwenvl_patch.scoring.answers import bare_point, try_parse_items

TRUTH_BOX_KEY = "bbox_orig"  # meta key: the truth box [x1, y1, x2, y2] in original-image pixels (convert writes it)
DENSE_SIGMA = 0.5  # click_dense: the Gaussian's width in box sizes (half a box outside: e^-0.5 = 0.61)

Point = tuple[float, float]
Box = Sequence[float]


def click_point(text: str) -> Point | None:
    """The click an answer commits to: its first ``point_2d``, or the centre of its first ``bbox_2d``, or a bare
    ``[x, y]`` answer; None when it has none or its coordinates are malformed. Only the first counts, so listing
    many points never buys a hit."""
    items = try_parse_items(text)
    if items:
        coords = items[0].coords
        if items[0].kind == "point_2d":
            return coords[0], coords[1]
        return (coords[0] + coords[2]) / 2, (coords[1] + coords[3]) / 2
    return bare_point(text) if items is not None else None


def click_hit(point: Point, box: Box) -> bool:
    """The point lies inside the box, edges included (ScreenSpot's rule)."""
    return box[0] <= point[0] <= box[2] and box[1] <= point[1] <= box[3]


def click_dense_score(point: Point, box: Box, sigma: float = DENSE_SIGMA) -> float:
    """1 inside the box; outside, a Gaussian of the distance to the box measured in box sizes per axis:
    ``exp(-(dx / (sigma w))^2 / 2 - (dy / (sigma h))^2 / 2)``, where dx, dy are how far the point lies outside the box's
    x and y spans. Normalising by the element's size (as GUI-G^2's Gaussian point rewards do) makes a near miss on a
    small icon cost as much as one on a wide text field; the plateau keeps every hit at exactly 1, the ``click``
    value."""
    x, y = point
    dx = max(box[0] - x, 0.0, x - box[2])
    dy = max(box[1] - y, 0.0, y - box[3])
    width, height = max(box[2] - box[0], 1.0), max(box[3] - box[1], 1.0)
    return math.exp(-0.5 * ((dx / (sigma * width)) ** 2 + (dy / (sigma * height)) ** 2))


def truth_box(reference: str, meta: Any, from_orig: Callable[[Sequence[float]], list[float]] | None) -> Box | None:
    """The box a click must land in, in the reference's frame: ``meta["bbox_orig"]`` (original pixels, mapped by
    ``from_orig``) when the record has it, else the reference's first ``bbox_2d``; None when neither exists (a
    reference that is only a point has no box to hit)."""
    if isinstance(meta, dict) and from_orig is not None:
        box = meta.get(TRUTH_BOX_KEY)
        if isinstance(box, list) and len(box) == 4 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box):
            return from_orig(box)
    for item in try_parse_items(reference) or []:
        if item.kind == "bbox_2d":
            return item.coords
    return None
