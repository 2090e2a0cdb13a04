"""The video side of one convert record: its clips resolved and probed (packet times and frame size; of the pixels
only the first frame is decoded, for its display rotation), a rotated clip settled by ``--video-rotation``, the
video frame its boxes go to, and its time labels checked against the clip. Boxes convert exactly like an image's,
through the video policy's frame (``VideoPolicy.frame_size``); times stay in seconds as written.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from llamafactory_qwenvl_patch.frame.policy import PolicyError
from llamafactory_qwenvl_patch.frame.stamp import Stamp
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.image_io.video import Clip, DisplayMatrix, display_matrix, probe
from llamafactory_qwenvl_patch.scoring import json_text
from qwenvl_prep.formats.records import RecordError
from qwenvl_prep.formats.video_labels import LabelError, clip_problems, frame_interval, video_labels
from qwenvl_prep.pipeline.video_bake import bake_rotation

ROTATION_MODES = ("error", "bake", "raw")
BAKED_DIR = "video_baked"  # under the output's folder
_clips: dict[Any, Clip] = {}
_rotations: dict[str, DisplayMatrix] = {}
DURATION_SLACK_S, DURATION_SLACK_SHARE = 1.0, 0.05  # a declared duration this close to the clip's is the same clip


def kind(video: str | list[str]) -> str:
    """``file`` for a video file, ``frames`` for a frame list (LF reads one kind per dataset)."""
    return "frames" if isinstance(video, list) else "file"


def name(video: str | list[str]) -> str:
    """How an error row names a clip: its path, or a frame list's first frame and length."""
    return video if isinstance(video, str) else f"{video[0] if video else '?'} (frame list of {len(video)})"


def resolve_videos(videos: list[str | list[str]], resolve: Callable[[str], str]) -> list[str | list[str]]:
    """Local paths of a record's videos (each frame of a frame list too), as images are resolved."""
    out: list[str | list[str]] = []
    for video in videos:
        if isinstance(video, list):
            if not video:
                raise RecordError("a frame list in 'videos' is empty")
            out.append([resolve(frame) for frame in video])
        else:
            out.append(resolve(video))
    if len({kind(v) for v in out}) > 1:
        raise RecordError("'videos' mixes video files and frame lists; LLaMA-Factory reads one kind per dataset")
    return out


def video_policy(stamp: Stamp) -> VideoPolicy:
    if stamp.video is None:
        raise PolicyError("the run has no video policy; give --from-yaml (LF's video keys, or their defaults)")
    return stamp.video


def list_fps(stamp: Stamp) -> float:
    """The rate frame lists are read at: the stamp's, else the video policy's ``fps`` (the plugin's default)."""
    return stamp.frame_list_fps if stamp.frame_list_fps is not None else float(video_policy(stamp).fps)


def clear_cache() -> None:
    _clips.clear()
    _rotations.clear()


def probe_clip(video: str | list[str], target: Stamp) -> Clip:
    """A clip's size and frame times (cached: a dataset asks about the same clip for many queries), checked against
    the target's video policy: a clip the policy cannot sample or size is a PolicyError naming it."""
    key = tuple(video) if isinstance(video, list) else video
    clip = _clips.get(key)
    if clip is None:
        if len(_clips) > 1024:
            _clips.clear()
        clip = probe(video, list_fps(target))
        clip.plan(video_policy(target))  # VideoError (a PolicyError) naming the clip
        _clips[key] = clip
    return clip


def upright(video: str | list[str], clip: Clip, mode: str, out_dir: str, target: Stamp
            ) -> tuple[str | list[str], Clip]:
    """The clip training should read and its probe, under ``--video-rotation``: a clip whose display matrix turns it
    is an error row (``error``), an upright copy under the output's folder (``bake``: labels are on the displayed
    clip) or kept as stored (``raw``: labels are on the stored frames, as training reads them). A mirrored clip
    (a selfie camera's, an editor's flip) is an error row under ``bake`` too: the copy is turned, never flipped."""
    if isinstance(video, list):
        return video, clip
    display = _rotations.get(video)
    if display is None:
        if len(_rotations) > 4096:
            _rotations.clear()
        display = _rotations[video] = display_matrix(video)
    if display.shown_as_stored or mode == "raw":
        return video, clip
    how = "mirrored" if display.mirrored else "rotated"
    if mode == "error":
        raise RecordError(
            f"video {video} is stored {how}: players {display.in_words()} (its display matrix), training reads the "
            f"stored frames, so the model would see it {how} and labels made on the displayed clip would not match. "
            + ("Flip the clip yourself (re-encode it with its display matrix applied), or pass --video-rotation raw "
               "(labels are on the stored frames)" if display.mirrored else
               "Pass --video-rotation bake (write an upright copy; labels are on the displayed clip) or "
               "--video-rotation raw (labels are on the stored frames)"))
    if display.mirrored:
        raise RecordError(
            f"video {video} is stored mirrored: players mirror it (its display matrix), and --video-rotation bake "
            "writes turned copies, never flipped ones. Flip the clip yourself (re-encode it with its display matrix "
            "applied), or pass --video-rotation raw (labels are on the stored frames)")
    baked = bake_rotation(video, display.degrees, os.path.join(out_dir, BAKED_DIR))
    return baked, probe_clip(baked, target)


def frame_sizes(target: Stamp, source_video: VideoPolicy | None, source_model: bool, hw: tuple[int, int]
                ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(target frame, source frame) of a clip of size ``hw``: the video policies' ``frame_size``."""
    target_hw = video_policy(target).frame_size(*hw)
    if not source_model:
        return target_hw, target_hw
    if source_video is None:
        raise PolicyError("the input is stamped in the model frame without a video policy, so its video boxes' frame "
                          "is unknown; convert the original data")
    return target_hw, source_video.frame_size(*hw)


def check_times(texts: list[str], clips: list[Clip], declared: Any) -> tuple[int, int]:
    """(spans, timed boxes) of a record's turns, each inside its clip; RecordError naming the clip otherwise. Time
    labels need exactly one video. A declared duration (``video-span``'s ``duration``) must be the clip's."""
    if declared is not None and len(clips) == 1:
        clip = clips[0]
        if abs(float(declared) - clip.duration) > max(DURATION_SLACK_S, DURATION_SLACK_SHARE * clip.duration):
            raise RecordError(f"video {clip.name}: the record declares a duration of {float(declared):g} s, the clip "
                              f"runs {clip.duration:g} s (another or a cut video?); its times would not match")
    spans = boxes = 0
    for text in texts:
        try:
            labels = video_labels(text)
        except LabelError as exc:
            raise RecordError(str(exc)) from None
        if not labels:
            continue
        if len(clips) != 1:
            raise RecordError(f"the record has time labels and {len(clips)} videos; time labels need exactly 1")
        clip = clips[0]
        problems = clip_problems(labels, clip.duration, frame_interval(clip.times, clip.duration))
        if problems:
            raise RecordError(f"video {clip.name}: {problems[0]}")
        spans += len(labels.spans)
        boxes += len(labels.boxes)
    return spans, boxes


def clamp_span_ends(text: str, duration: float) -> tuple[str, list[str]]:
    """A distributed dataset's answer (``{"span": [s, e]}`` or a list of them, as its reader wrote it) with every end
    past the clip's ``duration`` set to the clip's end (floored to the millisecond, so it never passes it), and the
    ends as written that were so set. A span that starts past the end is left for ``check_times`` to refuse: there
    is nothing of it in the clip."""
    value = json_text.loads(text)
    end = f"{math.floor(duration * 1000) / 1000:.3f}".rstrip("0").rstrip(".")
    clamped = []
    for item in value if isinstance(value, list) else [value]:
        span = item["span"]
        if span[0].value < float(end) and duration < span[1].value:  # a start past the floored end: left to check
            clamped.append(span[1].text)
            span[1] = json_text.Number(end)
    return (json_text.dumps(value, separators=(", ", ": ")) if clamped else text), clamped


def with_meta(meta: Any, key: str, value: Any) -> Any:
    """A record's ``meta`` (JSON text) with ``key`` set to ``value``; a meta that already says ``key``, or is not a
    JSON object, is left as it is."""
    if meta is None:
        return json_text.dumps({key: value}, separators=(", ", ": "))
    try:
        loaded = json_text.loads(meta) if isinstance(meta, str) else None
    except ValueError:
        return meta
    if not isinstance(loaded, dict) or key in loaded:
        return meta
    return json_text.dumps({**loaded, key: value}, separators=(", ", ": "))


def with_duration(meta: Any, clip: Clip) -> Any:
    """A single-video record's ``meta`` (JSON text) with the clip's length from its packets as ``duration`` in seconds,
    which rewards and eval read (``meta.duration``); a meta that already says ``duration``, or is not a JSON object,
    is left as it is."""
    return with_meta(meta, "duration", round(clip.duration, 6))
