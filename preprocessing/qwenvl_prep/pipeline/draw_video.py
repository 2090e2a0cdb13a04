"""``draw`` for a record with one video: a sheet of the frames the model samples (``image_io.video.read_clip``), in
the video frame the model sees or at the clip's original size (``--frame original``), each box of a track drawn on
the sampled frame nearest its time (a box without a time on every frame), and under it a timeline strip of the clip
with the sampled frames' times, the truth span (green) and a predicted span (red).

Frames are shrunk to tiles as they are decoded, so a long or large clip never sits in memory at full size.
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np
from PIL import Image

from llamafactory_qwenvl_patch.frame.policy import convert_coords
from llamafactory_qwenvl_patch.frame.stamp import Stamp
from llamafactory_qwenvl_patch.image_io.images import decode, describe, model_input_image, open_image
from llamafactory_qwenvl_patch.image_io.video import probe, read_clip
from llamafactory_qwenvl_patch.scoring.answers import Item, try_parse_items
from qwenvl_prep.formats.converted import Sample
from qwenvl_prep.formats.video_labels import VideoLabels, try_video_labels
from qwenvl_prep.pipeline.draw_shapes import GT_COLOR, PRED_COLOR, draw_items

TILE_HEIGHT = 180
COLUMNS = 8
STRIP_HEIGHT = 60
GAP = 3  # white between tiles
TEXT = (30, 30, 30)


def _labels(text: str | None) -> tuple[VideoLabels, list[Item]]:
    """A text's spans and timed boxes, and its boxes without a time (an unreadable answer gives none)."""
    if text is None:
        return VideoLabels(), []
    labels = try_video_labels(text) or VideoLabels()
    if labels.boxes:
        return labels, []
    return labels, try_parse_items(text) or []


def _tiles(sample: Sample, stamp: Stamp, frame: str) -> tuple[list[np.ndarray], list[float], float, Any]:
    """(BGR tiles of the distinct sampled frames, their times, the clip's duration, a function mapping the stamp's
    coordinates onto a tile)."""
    if stamp.video is None:
        raise ValueError(f"record {sample.index} has a video but the dataset's stamp has no video policy; convert it "
                         "again with qwenvl-prep convert (or give the video policy flags for an unstamped file)")
    policy, video = stamp.video, sample.videos[0]
    fps = stamp.frame_list_fps or float(policy.fps)
    clip = probe(video, fps)
    hw = (clip.height, clip.width)
    frame_hw = policy.frame_size(*hw)
    target, target_hw = ("model", frame_hw) if frame == "model" else ("orig", hw)
    scale = TILE_HEIGHT / target_hw[0]
    size = (max(1, round(target_hw[1] * scale)), TILE_HEIGHT)

    def tile(source: Any) -> np.ndarray:
        if frame == "model":
            image = model_input_image(source, policy.frame_policy)
        else:
            image = source if isinstance(source, Image.Image) else decode(open_image(source), describe(source))
        pixels = cv2.cvtColor(np.asarray(image.convert("RGB")), cv2.COLOR_RGB2BGR)
        return cv2.resize(pixels, size, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_NEAREST)

    tiles, plan = read_clip(video, policy, fps, tile, clip=clip)
    keep = [k for k in range(len(plan.times)) if k == 0 or plan.times[k] != plan.times[k - 1]]  # not the padding

    def mapped(items: list[Item]) -> list[list[float]]:
        return [[v * scale for v in convert_coords(it.coords, stamp.coords, target, hw, frame_hw, ndigits=None)]
                for it in items]

    return [tiles[k].copy() for k in keep], [plan.times[k] for k in keep], clip.duration, mapped


def _timeline(width: int, times: list[float], duration: float, truth: VideoLabels, predicted: VideoLabels | None
              ) -> np.ndarray:
    strip = np.full((STRIP_HEIGHT, width, 3), 255, np.uint8)
    x0, x1 = 10, max(11, width - 10)

    def x(t: float) -> int:
        return int(round(x0 + (x1 - x0) * min(max(t, 0.0), duration) / duration)) if duration > 0 else x0

    cv2.rectangle(strip, (x0, 14), (x1, 42), (225, 225, 225), -1)
    for t in times:
        cv2.line(strip, (x(t), 10), (x(t), 46), (150, 150, 150), 1)
    for start, end in truth.spans:
        cv2.rectangle(strip, (x(start), 14), (max(x(end), x(start) + 1), 27), GT_COLOR, -1)
    for start, end in (predicted.spans if predicted else []):
        cv2.rectangle(strip, (x(start), 29), (max(x(end), x(start) + 1), 42), PRED_COLOR, -1)
    cv2.putText(strip, "0 s", (x0, 57), cv2.FONT_HERSHEY_SIMPLEX, 0.4, TEXT, 1)
    end_text = f"{duration:.2f} s"
    cv2.putText(strip, end_text, (max(x0, x1 - 8 * len(end_text)), 57), cv2.FONT_HERSHEY_SIMPLEX, 0.4, TEXT, 1)
    return strip


def _draw_track(tiles: list[np.ndarray], times: list[float], labels: VideoLabels, untimed: list[Item], mapped: Any,
                color: tuple[int, int, int]) -> None:
    for box in labels.boxes:
        nearest = min(range(len(times)), key=lambda k: abs(times[k] - box.time))
        item = Item(box.kind, box.coords, box.label)
        draw_items(tiles[nearest], [item], mapped([item]), color, 1)
    for canvas in tiles if untimed else []:
        draw_items(canvas, untimed, mapped(untimed), color, 1)


def render_video(sample: Sample, stamp: Stamp, frame: str, prediction: str | None = None) -> np.ndarray:
    """BGR sheet of one video record's sampled frames with its track (green) and a predicted one (red), above the
    clip's timeline with the truth span (green) and the predicted span (red)."""
    tiles, times, duration, mapped = _tiles(sample, stamp, frame)
    truth, untimed = _labels(sample.answer)
    _draw_track(tiles, times, truth, untimed, mapped, GT_COLOR)
    predicted = None
    if prediction is not None:
        predicted, predicted_untimed = _labels(prediction)
        _draw_track(tiles, times, predicted, predicted_untimed, mapped, PRED_COLOR)
    for canvas, t in zip(tiles, times):
        cv2.putText(canvas, f"{t:.1f}s", (3, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 255, 255), 2)
        cv2.putText(canvas, f"{t:.1f}s", (3, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.4, TEXT, 1)
    columns = min(COLUMNS, len(tiles))
    step_x, step_y = tiles[0].shape[1] + GAP, TILE_HEIGHT + GAP
    rows = [tiles[i:i + columns] for i in range(0, len(tiles), columns)]
    sheet = np.full((step_y * len(rows) - GAP, step_x * columns - GAP, 3), 255, np.uint8)
    for r, row in enumerate(rows):
        for c, tile in enumerate(row):
            sheet[r * step_y:r * step_y + TILE_HEIGHT, c * step_x:c * step_x + tile.shape[1]] = tile
    return np.vstack([sheet, _timeline(sheet.shape[1], times, duration, truth, predicted)])
