"""Where a model folder keeps its frame: the ``qwenvl_policy.json`` record and the processor's bounds. The one
module that writes and reads both (training saves, export, serving, predict, fix-config, the drift audit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch import __version__
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.video import VideoPolicy, frame_list_times

POLICY_FILE = "qwenvl_policy.json"


def write_policy_record(folder: str | Path, policy: ResizePolicy, video: VideoPolicy | None = None,
                        frame_list_fps: float | None = None) -> None:
    """The folder's frame, and its video frame and clock under ``video`` (with the rate frame lists were read at,
    ``frame_list_fps``, so that predict and serving read them on the training clock)."""
    record = {**policy.to_dict(), "written_by": f"llamafactory-qwenvl-patch {__version__}"}
    if video is not None:
        record["video"] = {**video.to_dict(), **({"frame_list_fps": frame_list_fps} if frame_list_fps else {})}
    Path(folder, POLICY_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_policy_record(folder: str | Path) -> dict[str, Any] | None:
    """The folder's policy record (``min_pixels``, ``max_pixels``, ``factor``, ...), None when it has none; a
    record that cannot be read is a ValueError naming it."""
    path = Path(str(folder), POLICY_FILE)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        int(record["min_pixels"]), int(record["max_pixels"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a valid policy record ({exc}); re-export the model") from None
    return record


def set_image_processor_bounds(image_processor: Any, policy: ResizePolicy) -> None:
    """Pin the HF image processor's bounds on the instance (5.x constructors write into a class-level default)."""
    size = getattr(image_processor, "size", None)
    values = {"shortest_edge": policy.min_pixels, "longest_edge": policy.max_pixels}
    image_processor.size = type(size)(**values) if size is not None and not isinstance(size, dict) else values
    for attr, value in (("min_pixels", policy.min_pixels), ("max_pixels", policy.max_pixels)):
        if hasattr(image_processor, attr):
            setattr(image_processor, attr, value)


def set_video_processor_bounds(video_processor: Any, video: VideoPolicy) -> None:
    """Pin a per-frame HF video processor's bounds to the video policy's (``Family.video_bounds_per_frame``), so
    that an export's ``video_preprocessor_config.json`` states the training frame to readers without the plugin.
    Training never resizes with it (the pinned plugin hands it frames already in the frame, ``do_resize=False``)."""
    set_image_processor_bounds(video_processor, ResizePolicy(video.min_pixels, video.max_pixels, video.factor))


def read_processor_bounds(folder: str | Path) -> tuple[int, int] | None:
    """(min_pixels, max_pixels) from a model folder's processor config (either layout), None if it has none."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = Path(folder, name)
        if path.is_file():
            data = json.loads(path.read_text())
            data = data.get("image_processor", data)
            size = data.get("size") or {}
            low, high = data.get("min_pixels", size.get("shortest_edge")), data.get("max_pixels", size.get("longest_edge"))
            if low and high:
                return int(low), int(high)
    return None


def folder_video_policy(folder: str | Path) -> VideoPolicy | None:
    """The video policy a model folder was trained with, None when its record has none (an older export)."""
    found = folder_video(folder)
    return None if found is None else found[0]


def folder_video(folder: str | Path) -> tuple[VideoPolicy, float] | None:
    """(video policy, frame-list rate) a model folder was trained with (the rate defaults to the policy's fps, as
    training's does); None when its record has no video policy. A malformed one is a ValueError naming the file."""
    record = read_policy_record(folder)
    if record is None or record.get("video") is None:
        return None
    try:
        keys = dict(record["video"])
        frame_list_fps = float(keys.pop("frame_list_fps", None) or keys["fps"])
        policy = VideoPolicy(**keys)
        frame_list_times(1, frame_list_fps)  # the same bounds as a frame list's rate anywhere
        return policy, frame_list_fps
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{Path(str(folder), POLICY_FILE)}: its video policy is not valid ({exc!r}); re-export the "
                         "model") from None


def folder_policy(folder: str | Path, image_processor: Any) -> ResizePolicy:
    """The frame a model folder was trained in: its policy record, else its (pinned) image processor's bounds."""
    record = read_policy_record(folder)
    if record is not None:
        return ResizePolicy(int(record["min_pixels"]), int(record["max_pixels"]), int(record["factor"]))
    return ResizePolicy.from_processor(image_processor)
