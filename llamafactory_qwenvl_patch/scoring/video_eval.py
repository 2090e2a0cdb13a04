"""The video metrics of one eval pass, shared by ``qwenvl-prep eval`` and GRPO's evaluation: for span records R@1
at tIoU 0.3 / 0.5 / 0.7 and mean tIoU (the Charades-STA metrics), with the span monitors; for track records the
per-frame box metrics (Acc@0.5 and mean IoU over truth times) and the mean track score. A record is a video record
when its reference answer is a span or a track (``temporal.reference_kind``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from llamafactory_qwenvl_patch.scoring.answers import not_present
from llamafactory_qwenvl_patch.scoring.metrics import IOU_THRESHOLD, AbsentTally, _ratio
from llamafactory_qwenvl_patch.scoring.temporal import (
    SpanMonitorTally, TrackBox, meta_duration, parse_spans, parse_track, recall_at_1, reference_kind, score_track,
    try_parse_spans, try_parse_track,
)

ToFrame = Callable[[Sequence[float]], list[float]]

TIOU_THRESHOLDS = (0.3, 0.5, 0.7)


@dataclass
class SpanTally:
    """Running sums behind R@1 at each tIoU threshold (the answer's first span), mean tIoU and parse failures (a
    malformed answer or one with no span)."""

    samples: int = 0
    parse_failures: int = 0
    tiou_sum: float = 0.0
    hits: dict[float, int] = field(default_factory=lambda: dict.fromkeys(TIOU_THRESHOLDS, 0))

    def add(self, value: float, failed: bool) -> None:
        self.samples += 1
        self.parse_failures += failed
        self.tiou_sum += value
        for threshold in TIOU_THRESHOLDS:
            self.hits[threshold] += value >= threshold

    def to_dict(self) -> dict[str, Any]:
        n = self.samples
        return {"samples": n, **{f"r1@{t}": _ratio(self.hits[t], n) for t in TIOU_THRESHOLDS},
                "mean_tiou": _ratio(self.tiou_sum, n), "parse_failure_rate": _ratio(self.parse_failures, n)}


@dataclass
class TrackTally:
    """Running sums behind the per-frame box metrics of tracks: Acc@0.5 and mean IoU over every truth time (a time
    with no predicted box within the tolerance counts 0), the mean track score per record and parse failures."""

    samples: int = 0
    parse_failures: int = 0
    frames: int = 0
    hits: int = 0
    iou_sum: float = 0.0
    score_sum: float = 0.0

    def add(self, ious: tuple[float, ...], score: float, failed: bool) -> None:
        self.samples += 1
        self.parse_failures += failed
        self.frames += len(ious)
        self.hits += sum(value >= IOU_THRESHOLD for value in ious)
        self.iou_sum += sum(ious)
        self.score_sum += score

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "frames": self.frames, f"acc@{IOU_THRESHOLD}": _ratio(self.hits, self.frames),
                "mean_iou": _ratio(self.iou_sum, self.frames), "mean_track_score": _ratio(self.score_sum, self.samples),
                "parse_failure_rate": _ratio(self.parse_failures, self.samples)}


def _mapped(track: list[TrackBox], to_frame: ToFrame | None) -> list[TrackBox]:
    if to_frame is None:
        return track
    return [TrackBox(entry.time, tuple(to_frame(entry.box)), entry.label) for entry in track]


@dataclass
class VideoEval:
    """One pass over (reference, answer) pairs of video records."""

    spans: SpanTally = field(default_factory=SpanTally)
    tracks: TrackTally = field(default_factory=TrackTally)
    monitors: SpanMonitorTally = field(default_factory=SpanMonitorTally)
    absent: AbsentTally = field(default_factory=AbsentTally)

    def add(self, reference: str, answer: str, meta: Any, to_frame: ToFrame | None = None,
            has_video: bool = False) -> bool:
        """Score one record; False (nothing counted) when its reference is neither a span nor a track, nor ``[]``
        for a record with a video (an empty track: the target is not in the video). ``to_frame`` maps a track's
        boxes (answer and reference alike) into the frame of the metric, e.g. the clip's pixels, clamped to it;
        without it they are compared as written, where IoU is the same up to that clamping."""
        kind = reference_kind(reference)
        if kind is None and has_video and not_present(reference):
            self.absent.add(answer)
            return True
        if kind == "span":
            truth, predicted = parse_spans(reference), try_parse_spans(answer)
            self.spans.add(recall_at_1(truth, predicted or []), not predicted)
            self.monitors.add(truth, predicted, meta_duration(meta))
        elif kind == "track":
            truth_track, predicted_track = parse_track(reference), try_parse_track(answer)
            scored = score_track(_mapped(truth_track, to_frame), _mapped(predicted_track or [], to_frame))
            self.tracks.add(scored.ious, scored.score, not predicted_track)
        return kind is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.spans.samples:
            out["spans"] = self.spans.to_dict()
            out["span_monitors"] = self.monitors.to_dict()
        if self.tracks.samples:
            out["tracks"] = self.tracks.to_dict()
        if self.absent.samples:
            out["video_not_present"] = self.absent.to_dict()
        return out
