"""``qwenvl-prep draw``: boxes and points on the original image (mapped back) or on the exact model-input image; a
video record's sampled frames and timeline (``draw_video``)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from llamafactory_qwenvl_patch.scoring.answers import Item, bare_point, try_parse_items
from llamafactory_qwenvl_patch.scoring.clicks import truth_box
from llamafactory_qwenvl_patch.image_io.images import decode, model_input_image, open_image
from llamafactory_qwenvl_patch.frame.policy import convert_coords
from llamafactory_qwenvl_patch.frame.stamp import Stamp
from qwenvl_prep.plumbing.atomic import atomic_writer
from qwenvl_prep.formats.predictions import aligned
from qwenvl_prep.formats.converted import DatasetRef, Sample, iter_samples
from qwenvl_prep.pipeline.draw_shapes import GT_COLOR, PRED_COLOR, draw_items as _draw_items
from qwenvl_prep.pipeline.draw_video import render_video
from qwenvl_prep.plumbing.outputs import Outputs

THUMB_HEIGHT = 256


def render(sample: Sample, stamp: Stamp, frame: str, prediction: str | None = None) -> np.ndarray:
    """BGR image of one sample with ground truth (green) and an optional prediction (red)."""
    path = sample.images[0]
    image = decode(open_image(path), path).convert("RGB")
    hw = (image.height, image.width)
    model_hw = stamp.policy.model_size(*hw)
    if frame == "model":
        image, target, target_hw = model_input_image(path, stamp.policy), "model", model_hw
    else:
        target, target_hw = "orig", hw
    canvas = cv2.cvtColor(np.asarray(image), cv2.COLOR_RGB2BGR)
    thickness = max(1, round(max(target_hw) / 500))

    def mapped(items: list[Item]) -> list[list[float]]:
        return [convert_coords(it.coords, stamp.coords, target, hw, model_hw, ndigits=None) for it in items]

    _draw_items(canvas, sample.items, mapped(sample.items), GT_COLOR, thickness)
    box = truth_box("", sample.meta, list)  # a click record's target element, in original pixels
    if box is not None:
        _draw_items(canvas, [Item("bbox_2d", tuple(box))], [convert_coords(box, "orig", target, hw, model_hw,
                                                                             ndigits=None)], GT_COLOR, thickness)
    if prediction is not None:
        predicted = try_parse_items(prediction) or []
        point = bare_point(prediction) if predicted == [] else None
        if point is not None:  # a bare [x, y] click
            predicted = [Item("point_2d", point)]
        _draw_items(canvas, predicted, mapped(predicted), PRED_COLOR, thickness)
    return canvas


def thumbnail(image: np.ndarray) -> np.ndarray:
    return cv2.resize(image, (max(1, round(image.shape[1] * THUMB_HEIGHT / image.shape[0])), THUMB_HEIGHT))


def contact_sheet(thumbs: list[np.ndarray], columns: int = 4) -> np.ndarray:
    """Thumbnails (``thumbnail``) in rows of ``columns``: only thumbnails are kept, so memory stays flat."""
    rows = [thumbs[i:i + columns] for i in range(0, len(thumbs), columns)]
    width = max(sum(t.shape[1] for t in row) for row in rows)
    sheet = np.full((THUMB_HEIGHT * len(rows), width, 3), 255, np.uint8)
    for r, row in enumerate(rows):
        x = 0
        for thumb in row:
            sheet[r * THUMB_HEIGHT:(r + 1) * THUMB_HEIGHT, x:x + thumb.shape[1]] = thumb
            x += thumb.shape[1]
    return sheet


def _write_image(path: Path, image: np.ndarray) -> None:
    ok, data = cv2.imencode(path.suffix, image)
    if not ok:
        raise ValueError(f"cannot encode {path}")
    with atomic_writer(path, "wb") as f:
        f.write(data.tobytes())


def safe_stem(name: str) -> str:
    """A dataset name as a file-name stem: no separators or ``..`` (a name like ``../x`` wrote outside -o)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return stem or "dataset"


def draw(ref: DatasetRef, stamp: Stamp, out_dir: Path, frame: str = "original", sample: int = 16, seed: int = 0,
         predictions: Path | None = None) -> dict[str, Any]:
    """Draw a random sample of N records (all if N <= 0) and a contact sheet; returns the written paths. Every
    output path is checked (``outputs``: inside ``out_dir``, never an input or a registered file) before the first
    is written."""
    samples = [s for s in iter_samples(ref) if not s.error and len(s.images) + len(s.videos) == 1]
    preds = [text for _, _, text in aligned(ref, predictions)] if predictions else None  # checked as eval checks
    chosen = samples if sample <= 0 or sample >= len(samples) else random.Random(seed).sample(samples, sample)
    chosen.sort(key=lambda s: s.index)
    stem = safe_stem(ref.name)
    videos = [f for s in samples for v in s.videos for f in (v if isinstance(v, list) else [v])]
    guard = Outputs([p for s in samples for p in s.images] + videos
                    + [ref.path, *([predictions] if predictions else [])],
                    [ref.media_dir])
    paths = [guard.check(Path(out_dir) / f"{stem}-{s.index:06d}-{frame}.jpg", "draw output", inside=out_dir)
             for s in chosen]
    sheet = guard.check(Path(out_dir) / f"{stem}-contact-sheet-{frame}.jpg", "draw output", inside=out_dir) \
        if chosen else None
    drawn = []
    for s, path in zip(chosen, paths):
        prediction = preds[s.index] if preds and s.index < len(preds) else None
        canvas = render_video(s, stamp, frame, prediction) if s.videos else render(s, stamp, frame, prediction)
        _write_image(path, canvas)
        drawn.append(thumbnail(canvas))
    if sheet is not None:
        _write_image(sheet, contact_sheet(drawn))
    return {"images": [str(p) for p in paths], "contact_sheet": str(sheet) if sheet else None}


def prediction_paths(count: int, out_dir: Path) -> list[Path]:
    return [Path(out_dir) / f"prediction-{i:04d}.jpg" for i in range(count)]


def draw_predictions(rows: list[dict[str, Any]], paths: list[Path]) -> list[str]:
    """Draw ``qwenvl-prep predict`` rows (boxes already in original pixels) on their original images, one to each
    of ``paths`` (``prediction_paths``, checked by the caller before anything was written)."""
    for row, path in zip(rows, paths):
        image = row["image"]
        canvas = cv2.cvtColor(np.asarray(decode(open_image(image), image).convert("RGB")), cv2.COLOR_RGB2BGR)
        items = [Item(it["kind"], tuple(it["orig"]), it.get("label")) for it in row["items"]]
        _draw_items(canvas, items, [list(it.coords) for it in items], PRED_COLOR, max(1, round(max(canvas.shape) / 500)))
        _write_image(path, canvas)
    return [str(p) for p in paths[:len(rows)]]
