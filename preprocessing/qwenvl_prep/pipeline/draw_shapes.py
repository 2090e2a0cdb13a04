"""The shapes ``draw`` paints: boxes and points in a colour over a dark halo, shared by image and video drawings."""

from __future__ import annotations

from typing import Sequence

import cv2
import numpy as np

from llamafactory_qwenvl_patch.scoring.answers import Item

GT_COLOR = (60, 200, 60)  # BGR green
PRED_COLOR = (40, 40, 230)  # BGR red
HALO_COLOR = (20, 20, 20)  # under every shape, so that it shows on objects of its own colour


def draw_items(canvas: np.ndarray, items: Sequence[Item], coords: list[list[float]], color: tuple[int, int, int],
               thickness: int) -> None:
    """Each shape in ``color`` over a dark halo one pixel wider on each side, so that a green truth box stays
    visible on a green object (and a red one on red)."""
    for item, values in zip(items, coords):
        pts = [int(round(v)) for v in values]
        for paint, extra in ((HALO_COLOR, 2), (color, 0)):
            if item.kind == "bbox_2d":
                cv2.rectangle(canvas, (pts[0], pts[1]), (pts[2], pts[3]), paint, thickness + extra)
                anchor = (pts[0], max(pts[1] - 4, 12))
            else:
                cv2.circle(canvas, (pts[0], pts[1]), 3 * thickness + extra // 2, paint, -1)
                anchor = (pts[0] + 4, pts[1])
            if item.label:
                cv2.putText(canvas, item.label, anchor, cv2.FONT_HERSHEY_SIMPLEX, 0.4 * thickness, paint,
                            thickness + extra)
