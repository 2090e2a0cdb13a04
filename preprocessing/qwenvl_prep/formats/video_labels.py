"""The time labels of a video answer, and whether they lie in the clip.

Label formats (``docs/video-data.md``): a box track is a JSON list of ``{"time": <seconds from the clip's start>,
"bbox_2d": [x1, y1, x2, y2], "label": ...}`` (``point_2d`` too), its coordinates in the family's convention of the
video frame; a temporal span is ``{"span": [start_seconds, end_seconds]}``. Coordinates are found and converted by
``scoring.answers`` like an image's; times are seconds of the clip and are never converted, only checked here: a span
must start at 0 or later, end after it starts and end at most one frame after the clip does; a track's time must lie
in the same range.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from llamafactory_qwenvl_patch.scoring import json_text

COORD_KEYS = ("bbox_2d", "point_2d")
_DECODER = json.JSONDecoder()


class LabelError(ValueError):
    """A time label that cannot be read (a span that is not two numbers, a time that is not a number)."""


@dataclass(frozen=True)
class TrackBox:
    """One box (or point) of a track: the time it is labelled at, in seconds, and its coordinates as written."""

    time: float
    kind: str
    coords: tuple[float, ...]
    label: str | None = None


@dataclass
class VideoLabels:
    spans: list[tuple[float, float]] = field(default_factory=list)
    boxes: list[TrackBox] = field(default_factory=list)  # the boxes and points that carry a time

    def __bool__(self) -> bool:
        return bool(self.spans or self.boxes)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _walk(value: Any, out: VideoLabels, depth: int = 0) -> None:
    if depth > 64:
        return
    if isinstance(value, dict):
        if "span" in value:
            span = value["span"]
            if not (isinstance(span, list) and len(span) == 2 and all(map(_number, span))):
                raise LabelError(f"span {span!r} must be [start, end], two numbers of seconds")
            out.spans.append((float(span[0]), float(span[1])))
        kinds = [k for k in COORD_KEYS if k in value]
        if "time" in value and kinds:
            if not _number(value["time"]):
                raise LabelError(f"track time {value['time']!r} must be a number of seconds")
            label = value.get("label")
            for kind in kinds:
                coords = value[kind]
                if isinstance(coords, list) and all(map(_number, coords)):
                    out.boxes.append(TrackBox(float(value["time"]), kind, tuple(float(v) for v in coords),
                                              None if label is None else str(label)))
        for child in value.values():
            if isinstance(child, (dict, list)):
                _walk(child, out, depth + 1)
    elif isinstance(value, list):
        for child in value:
            if isinstance(child, (dict, list)):
                _walk(child, out, depth + 1)


def video_labels(text: str) -> VideoLabels:
    """The spans and timed boxes of a text; LabelError when one is malformed."""
    out = VideoLabels()
    if "span" not in text and "time" not in text:
        return out
    # every JSON array or object, the whole text's, fence bodies' and those in prose alike, found as the answer
    # parser finds them; read by Python's json (a repeated key keeps its last value), too deep a nesting is no JSON
    for _, _, value in json_text.embedded(text, _DECODER.raw_decode, not_json=(ValueError, RecursionError)):
        _walk(value, out)
    return out


def try_video_labels(text: str) -> VideoLabels | None:
    """A model's answer's labels, None when malformed (drawn as a parse failure instead of stopping)."""
    try:
        return video_labels(text)
    except LabelError:
        return None


def clip_problems(labels: VideoLabels, duration: float, frame_interval: float) -> list[str]:
    """Why labels do not fit a clip of ``duration`` seconds whose frames are ``frame_interval`` apart (a label may
    end up to one frame after the clip's end); [] when they fit."""
    limit = duration + frame_interval
    where = f"the clip (0 to {duration:g} s, one frame of {frame_interval:g} s allowed past its end)"
    out = []
    for start, end in labels.spans:
        if end <= start:
            out.append(f"span [{start:g}, {end:g}] ends before it starts (need start < end, in seconds)")
        elif start < 0 or end > limit + 1e-6:
            out.append(f"span [{start:g}, {end:g}] lies outside {where}")
    for box in labels.boxes:
        if not 0 <= box.time <= limit + 1e-6:
            out.append(f"track time {box.time:g} s lies outside {where}")
    return out


def frame_interval(times: tuple[float, ...] | list[float], duration: float) -> float:
    """A clip's frame interval, from its frame times and duration (0 for a single frame)."""
    return duration / len(times) if len(times) > 1 and duration > 0 else 0.0
