"""What a clip's container states about its length, read to tell a cut clip from a short one.

A file cut short (an interrupted copy or download) often still opens: a faststart mp4 keeps its sample table at the
front, listing every frame, and a webm keeps its header's duration. Its packets then stop early, and a probe that
trusts the packets alone sees a shorter, whole clip, to which labels made on the whole clip do not belong. So the
packets read are compared with what the header states: its seconds (the stream's duration, a Matroska track's
``DURATION`` tag, or the container's when the clip is its only stream), else its frame count (an AVI's), the frames
not there timed at the rate of those read, against the same tolerance. An mp4's sample table is not compared: an
edit list that trims a clip keeps the hidden frames in it (ffmpeg reads none of them), and states the trimmed seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRUNCATION_SLACK_S = 0.25  # packets ending this close to the stated end (or 2 frame intervals) are the whole clip
PAST_ITS_END = "labels made on the whole clip would point past its end (an interrupted copy or download?)"


@dataclass(frozen=True)
class StatedLength:
    """A video stream's length as its container states it: frames (0: not stated) and seconds from the stream's
    start (None: not stated)."""

    frames: int
    seconds: float | None

    def describe(self) -> str:
        parts = ([f"{self.frames} frames"] if self.frames else []) + (
            [f"{self.seconds:g} s"] if self.seconds is not None else [])
        return " over ".join(parts)


def stated_length(container: Any, stream: Any) -> StatedLength:
    """What ``container`` states of ``stream``'s length (PyAV objects): its frame count (an AVI's alone) and its
    duration, else a Matroska ``DURATION`` tag, else the container's duration when the stream is its only one."""
    frames = int(stream.frames or 0)
    if frames and container.format.name == "avi":
        # its header states a frame count; once the index at the file's end is gone (a cut), ffmpeg's durations are
        # a guess from the file's size, which shrinks with the cut
        return StatedLength(frames, None)
    if stream.duration and stream.time_base:
        return StatedLength(frames, float(stream.duration * stream.time_base))
    tag = _tag_seconds((stream.metadata or {}).get("DURATION"))
    if tag is not None:
        return StatedLength(frames, tag)
    if container.duration and len(container.streams) == 1:
        import av

        return StatedLength(frames, container.duration / av.time_base)
    return StatedLength(frames, None)


def _tag_seconds(text: Any) -> float | None:
    """``HH:MM:SS.fraction`` (Matroska's per-track ``DURATION`` tag as ffmpeg writes it) in seconds, else None."""
    try:
        hours, minutes, seconds = str(text).split(":")
        value = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None


def truncation(stated: StatedLength, frames_read: int, seconds_read: float, interval: float) -> str | None:
    """Why a clip is cut short, or None: its packets end well before the stated seconds, or, where the header states
    only a frame count, the frames not there would last that long at the rate of those read (well: more than 2 frame
    intervals or ``TRUNCATION_SLACK_S``); or there are none where the header states some. Times are from the stream's
    start; ``frames_read`` counts every packet, as a header's frame count does."""
    if frames_read == 0 and (stated.frames or stated.seconds):
        return (f"is truncated or corrupt: its header states {stated.describe()}, but the file holds no frame data "
                "(an interrupted copy or download?)")
    slack = max(TRUNCATION_SLACK_S, 2 * interval)
    if stated.seconds is not None and stated.seconds - seconds_read > slack:
        return (f"is truncated or corrupt: its header states {stated.describe()}, but its packets stop after "
                f"{frames_read} frames ({seconds_read:g} s); {PAST_ITS_END}")
    missing = stated.frames - frames_read
    if stated.seconds is None and missing > 0 and missing * seconds_read / frames_read > slack:
        return (f"is truncated or corrupt: its index lists {stated.frames} frames, {frames_read} are there "
                f"({seconds_read:g} s); {PAST_ITS_END}")
    return None
