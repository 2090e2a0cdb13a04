"""Click grounding (GUI agents): the point an answer clicks, scored against the truth box (pure functions).

Every function works in one frame, whatever it is: the caller passes the point and the box in the same units
(Qwen2.5-VL model pixels, 0-1000 for Qwen2-VL and Qwen3-VL, or original pixels in eval).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


CENTRE_TOLERANCE = 0.02  # a click within 2% of the frame's side from its centre, per axis, is a centre click


@dataclass
class ClickMonitorTally:
    """Running counts behind the click-hack monitors of a batch: answers naming more than one point or box where
    one click is asked (only the first counts, see ``click_point``), clicks outside the image, groups whose every
    sample clicks the same point, and clicks on the image's centre (the constant answer a collapsed policy gives).
    The multi-point rate is of all answers, the outside and centre rates of answers with a click, the group rate of
    groups."""

    answers: int = 0
    clicks: int = 0
    multi_point: int = 0
    outside: int = 0
    centre: int = 0
    groups: int = 0
    same_point_groups: int = 0

    def add_group(self, texts: Sequence[str], extent: tuple[float, float]) -> None:
        """The completions of one prompt, in a frame of ``extent`` (width, height) in the answers' units."""
        width, height = extent
        points = []
        for text in texts:
            self.answers += 1
            self.multi_point += len(try_parse_items(text) or []) > 1
            point = click_point(text)
            points.append(point)
            if point is None:
                continue
            self.clicks += 1
            self.outside += not (0 <= point[0] <= width and 0 <= point[1] <= height)
            self.centre += (abs(point[0] - width / 2) <= CENTRE_TOLERANCE * width
                            and abs(point[1] - height / 2) <= CENTRE_TOLERANCE * height)
        self.groups += 1
        self.same_point_groups += len(points) > 1 and points[0] is not None and all(p == points[0] for p in points)

    def merge(self, other: "ClickMonitorTally") -> None:
        """Add another tally's counts (another rank's): rates stay exact, not means of means."""
        for name in ("answers", "clicks", "multi_point", "outside", "centre", "groups", "same_point_groups"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, float | None]:
        return {
            "click_multi_point_rate": self.multi_point / self.answers if self.answers else None,
            "click_outside_rate": self.outside / self.clicks if self.clicks else None,
            "click_centre_rate": self.centre / self.clicks if self.clicks else None,
            "click_same_point_group_rate": self.same_point_groups / self.groups if self.groups else None,
        }
