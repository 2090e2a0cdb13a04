"""Video answers (pure functions): temporal spans ``{"span": [start, end]}`` and box tracks ``[{"time": t,
"bbox_2d": [x1, y1, x2, y2], "label": ...}]``, read from a model's text as robustly as boxes are (``answers``:
bare, fenced, in prose, nested, double-encoded, read as written); temporal IoU; the spatio-temporal track score;
the reward hacks of temporal grounding and their monitors.

Times are seconds of the clip. Track boxes are in any one frame: IoU does not change when both axes are scaled, so a
track scores the same in the model's frame as in the clip's pixels.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterator, Sequence

from llamafactory_qwenvl_patch.frame.video import TIME_EPSILON
from llamafactory_qwenvl_patch.scoring import json_text
from llamafactory_qwenvl_patch.scoring.answers import AnswerError, json_values, read_number, too_many_items
from llamafactory_qwenvl_patch.scoring.json_text import JSONTextError
from llamafactory_qwenvl_patch.scoring.metrics import iou

SPAN_KEY, TIME_KEY, BOX_KEY = "span", "time", "bbox_2d"
# JSON-looking text that must be read: a quoted key with a number after it (the bare word "span" is prose)
_SPAN_TEXT = re.compile(r"[\"']span[\"']\s*:\s*[\[(]?\s*[-+]?\.?\d")
_TIME_TEXT = re.compile(r"[\"']time[\"']\s*:\s*[-+]?\.?\d")
MAX_TOLERANCE_S = 0.5  # a truth time takes the predicted box at most this far away (less for denser truth)
WHOLE_CLIP_SHARE = 0.8  # a span covering this share of the clip answers "all of it"
WHOLE_CLIP_TRUTH = 0.5  # ... which is a hack only when no truth span covers even this share
BEYOND_CLIP_S = 0.5  # a span reaching further than this before 0 or past the clip's end lies outside it
SPAN_HACKS = ("whole_clip", "degenerate", "beyond_clip", "many_spans")

Span = tuple[float, float]


@dataclass(frozen=True)
class TrackBox:
    """One box of a track: where the object is at ``time`` seconds."""

    time: float
    box: tuple[float, ...]  # x1, y1, x2, y2
    label: str | None = None


def _decoded(value: str) -> Any:
    """A double-encoded JSON value inside a string, or None when the string is not JSON."""
    try:
        return json_text.loads(value, allow_nan=True)
    except JSONTextError as exc:
        raise AnswerError(str(exc)) from None
    except ValueError:
        return None


def _objects(value: Any) -> Iterator[dict]:
    """Every JSON object in ``value``, in text order, also inside double-encoded strings."""
    if isinstance(value, dict):
        yield value
        for child in value.values():
            yield from _objects(child)
    elif isinstance(value, list):
        for child in value:
            yield from _objects(child)
    elif isinstance(value, str) and (f'"{SPAN_KEY}"' in value or f'"{TIME_KEY}"' in value):
        inner = _decoded(value)
        if inner is not None:
            yield from _objects(inner)


def _has_key(key: str) -> Callable[[Any], bool]:
    """Whether a JSON value holds an object with ``key``: the values ``json_values`` keeps."""
    def wanted(value: Any) -> bool:
        try:
            return any(key in obj for obj in _objects(value))
        except AnswerError:
            return True  # read it, so that its error is raised
    return wanted


def parse_spans(text: str) -> list[Span]:
    """Every ``span`` of an answer as (start, end) seconds, in text order, as written (an inverted span stays
    inverted); [] when it has none; AnswerError when one is not two numbers or span-like text cannot be read."""
    spans = []
    for value in json_values(text, _has_key(SPAN_KEY), _SPAN_TEXT, '{"span": [start, end]} JSON'):
        for obj in _objects(value):
            if SPAN_KEY in obj:
                pair = obj[SPAN_KEY]
                if not isinstance(pair, list) or len(pair) != 2:
                    raise AnswerError(f"span must be a list of 2 numbers (start, end seconds), got {pair!r}")
                spans.append((read_number(pair[0], "span start"), read_number(pair[1], "span end")))
    return spans


def parse_track(text: str) -> list[TrackBox]:
    """Every timed box of an answer, in text order; [] when it has none; AnswerError when an entry has a time but no
    4-number ``bbox_2d``, a box sits untimed beside timed ones, or track-like text cannot be read."""
    track = []
    for value in json_values(text, _has_key(TIME_KEY), _TIME_TEXT, '[{"time": t, "bbox_2d": [...]}] JSON'):
        for obj in _objects(value):
            if TIME_KEY not in obj:
                if BOX_KEY in obj:
                    raise AnswerError(f"a box without a time in a track: {obj[BOX_KEY]!r}")
                continue
            box = obj.get(BOX_KEY)
            if not isinstance(box, list) or len(box) != 4:
                raise AnswerError(f"a track entry needs bbox_2d as a list of 4 numbers, got {box!r}")
            label = obj.get("label")
            track.append(TrackBox(read_number(obj[TIME_KEY], "time"), tuple(read_number(v, "coordinate") for v in box),
                                  None if label is None else str(label)))
    return track


def try_parse_spans(text: str) -> list[Span] | None:
    """``parse_spans``, or None for a malformed answer or one longer than a model writes (``too_many_items``):
    scored as a parse failure, never raised."""
    if too_many_items(text) is not None:
        return None
    try:
        return parse_spans(text)
    except AnswerError:
        return None


def try_parse_track(text: str) -> list[TrackBox] | None:
    """``parse_track``, or None for a malformed answer or one longer than a model writes."""
    if too_many_items(text) is not None:
        return None
    try:
        return parse_track(text)
    except AnswerError:
        return None


@lru_cache(maxsize=4096)
def reference_kind(reference: str) -> str | None:
    """``span`` or ``track`` for a video reference, None otherwise (images, fields, text). Cached: a reward sees each
    reference once per completion of its group."""
    if try_parse_spans(reference):
        return "span"
    if try_parse_track(reference):
        return "track"
    return None


def meta_duration(meta: Any) -> float | None:
    """The clip's length in seconds from a record's ``meta.duration``; None when absent or not a number > 0."""
    value = meta.get("duration") if isinstance(meta, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def tiou(a: Span, b: Span) -> float:
    """Temporal IoU of two (start, end) spans in [0, 1]; 0 when either is empty or inverted (an inverted span is
    never swapped into a right one: the order is part of the answer)."""
    if a[1] <= a[0] or b[1] <= b[0]:
        return 0.0
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    return inter / ((a[1] - a[0]) + (b[1] - b[0]) - inter)


def span_score(truth: Sequence[Span], predicted: Sequence[Span]) -> float:
    """Spans matched one-to-one for the highest total tIoU, summed, over max(#truth, #predicted): as ``iou`` does
    for boxes, so listing many spans to hit one divides the credit by their number."""
    if not truth or not predicted:
        return 0.0
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    scores = np.array([[tiou(t, p) for p in predicted] for t in truth])
    rows, cols = linear_sum_assignment(scores, maximize=True)
    return float(scores[rows, cols].sum()) / max(len(truth), len(predicted))


def recall_at_1(truth: Sequence[Span], predicted: Sequence[Span]) -> float:
    """tIoU of the answer's first span (its top-1 moment) with the truth span it overlaps most; 0 with none."""
    return max((tiou(t, predicted[0]) for t in truth), default=0.0) if predicted else 0.0


def track_tolerance(truth: Sequence[TrackBox]) -> float:
    """Seconds a truth time may lie from the predicted time whose box it takes: half the median gap between the
    truth's times (so a box can stand for its own frame only), at most ``MAX_TOLERANCE_S``."""
    times = sorted({entry.time for entry in truth})
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return min(MAX_TOLERANCE_S, gaps[len(gaps) // 2] / 2) if gaps else MAX_TOLERANCE_S


@dataclass(frozen=True)
class TrackScore:
    """A predicted track against the truth: the IoU at each truth time (0 where no predicted box lies within the
    tolerance) and the predicted boxes that stand for no truth time (``extra``)."""

    ious: tuple[float, ...]
    extra: int

    @property
    def score(self) -> float:
        """Summed IoU over truth times plus extra boxes (vIoU of VidSTG / HC-STVG, over times instead of frames)."""
        return sum(self.ious) / (len(self.ious) + self.extra) if self.ious else 0.0


def score_track(truth: Sequence[TrackBox], predicted: Sequence[TrackBox]) -> TrackScore:
    """Each truth time takes the box at the nearest predicted time within ``track_tolerance`` (of several boxes at
    one time, the first written: hedging with a second box buys nothing). Extra, and so penalised: a repeated time's
    later boxes, and boxes before the truth's first time or after its last by more than the tolerance (the object
    is not the target there). Boxes between truth times are not extra: the truth may be annotated more sparsely
    than the model answers."""
    tolerance = track_tolerance(truth) + TIME_EPSILON  # a time exactly at the tolerance, as float subtraction gives it
    first: dict[float, TrackBox] = {}
    for entry in predicted:
        first.setdefault(entry.time, entry)
    extra = len(predicted) - len(first)
    times = sorted(first)
    ious = []
    for entry in truth:
        at = bisect.bisect_left(times, entry.time)
        near = min(times[max(0, at - 1):at + 1], key=lambda t: (abs(t - entry.time), t), default=None)
        ious.append(iou(entry.box, first[near].box) if near is not None and abs(near - entry.time) <= tolerance
                    else 0.0)
    if truth:
        low, high = min(e.time for e in truth) - tolerance, max(e.time for e in truth) + tolerance
        extra += sum(not low <= t <= high for t in times)
    return TrackScore(tuple(ious), extra)


def _covered(span: Span, duration: float) -> float:
    return max(0.0, min(span[1], duration) - max(span[0], 0.0))


def span_hacks(truth: Sequence[Span], predicted: Sequence[Span], duration: float | None) -> list[str]:
    """The temporal-grounding hacks an answer shows, in ``SPAN_HACKS`` order: ``whole_clip`` (a span over >= 80% of
    the clip when no truth span covers half of it; needs the duration), ``degenerate`` (an empty or inverted span),
    ``beyond_clip`` (a span reaching more than 0.5 s before 0 or past the clip's end) and ``many_spans`` (more spans
    than the truth has)."""
    found = []
    if duration and max((_covered(t, duration) for t in truth), default=0.0) < WHOLE_CLIP_TRUTH * duration and any(
            _covered(p, duration) >= WHOLE_CLIP_SHARE * duration for p in predicted):
        found.append("whole_clip")
    if any(p[1] <= p[0] for p in predicted):
        found.append("degenerate")
    if any(min(p) < -BEYOND_CLIP_S or (duration is not None and max(p) > duration + BEYOND_CLIP_S)
           for p in predicted):
        found.append("beyond_clip")
    if len(predicted) > max(len(truth), 1):
        found.append("many_spans")
    return found


@dataclass
class SpanMonitorTally:
    """Running counts behind the span monitors of one batch or one eval: the rate of each hack of ``span_hacks``,
    of answers with no readable span, and the median length of the answer's first span over the truth's."""

    answers: int = 0
    empty: int = 0
    hacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPAN_HACKS, 0))
    length_ratios: list[float] = field(default_factory=list)

    def add(self, truth: Sequence[Span], predicted: Sequence[Span] | None, duration: float | None) -> None:
        """One answer (None: malformed, counted as an answer with no span) against its truth spans."""
        predicted = predicted or []
        self.answers += 1
        self.empty += not predicted
        for name in span_hacks(truth, predicted, duration):
            self.hacks[name] += 1
        if predicted and truth and truth[0][1] > truth[0][0]:
            self.length_ratios.append(max(0.0, predicted[0][1] - predicted[0][0]) / (truth[0][1] - truth[0][0]))

    def merge(self, other: "SpanMonitorTally") -> None:
        """Add another tally's counts (another rank's, or another rollout's): rates stay exact."""
        self.answers += other.answers
        self.empty += other.empty
        for name in SPAN_HACKS:
            self.hacks[name] += other.hacks[name]
        self.length_ratios += other.length_ratios

    def to_dict(self) -> dict[str, float | None]:
        n = self.answers
        out: dict[str, float | None] = {f"span_{name}_rate": self.hacks[name] / n if n else None
                                        for name in SPAN_HACKS}
        out["span_empty_answer_rate"] = self.empty / n if n else None
        out["span_length_ratio_median"] = statistics.median(self.length_ratios) if self.length_ratios else None
        return out
