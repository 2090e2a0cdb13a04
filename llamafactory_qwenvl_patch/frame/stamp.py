"""The policy stamp that ``qwenvl-prep convert`` writes into a ``dataset_info.json`` entry, and its comparison.

The stamp says which frame a dataset's coordinates are in; training refuses a dataset stamped for another frame.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy
from llamafactory_qwenvl_patch.frame.video import VideoPolicy

STAMP_KEY = "qwenvl_policy"


@dataclass(frozen=True)
class Stamp:
    """Resize policy plus coordinate convention (``model`` or ``rel1000``) and model family of a dataset; a dataset
    with videos also carries its video policy (``video``), the frame and clock its video labels are in, and a dataset
    of frame lists the rate its frames were taken at (``frame_list_fps``, written inside the ``video`` object: a
    frame list's times, and so its labels' times, follow from it)."""

    policy: ResizePolicy
    coords: str
    family: str
    written_by: str = ""
    video: VideoPolicy | None = None
    frame_list_fps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {**self.policy.to_dict(), "coords": self.coords, "family": self.family, "written_by": self.written_by}
        if self.video is None:
            return out
        video = self.video.to_dict()
        if self.frame_list_fps is not None:
            video["frame_list_fps"] = self.frame_list_fps
        return {**out, "video": video}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Stamp":
        """A stamp read back; a stamp missing a field or holding a non-integer is a StampError naming it (it was
        edited by hand, or written by something else)."""
        missing = [key for key in ("min_pixels", "max_pixels", "factor", "coords") if key not in data]
        if missing:
            raise StampError(f"the {STAMP_KEY} stamp {data!r} lacks {', '.join(missing)}; convert the data again "
                             "with qwenvl-prep convert")
        try:
            policy = ResizePolicy(int(data["min_pixels"]), int(data["max_pixels"]), int(data["factor"]))
        except (TypeError, ValueError) as exc:
            raise StampError(f"the {STAMP_KEY} stamp {data!r} is malformed ({exc})") from None
        video, frame_list_fps = None, None
        if data.get("video") is not None:
            try:
                keys = dict(data["video"])
                frame_list_fps = keys.pop("frame_list_fps", None)
                video = VideoPolicy(**keys)
                if frame_list_fps is not None:
                    frame_list_fps = float(frame_list_fps)
                    if not (math.isfinite(frame_list_fps) and frame_list_fps > 0):
                        raise PolicyError(f"frame_list_fps must be a finite number > 0, got {frame_list_fps!r}")
            except (TypeError, ValueError) as exc:
                raise StampError(f"the {STAMP_KEY} stamp's video policy {data['video']!r} is malformed ({exc}); "
                                 "convert the data again with qwenvl-prep convert") from None
        return cls(policy, str(data["coords"]), str(data.get("family", "")), str(data.get("written_by", "")), video,
                   frame_list_fps)

    def describe(self) -> str:
        p = self.policy
        return (f"min_pixels={p.min_pixels}, max_pixels={p.max_pixels}, factor={p.factor}, "
                f"coords={self.coords} ({self.family or 'unknown family'})")


class StampError(ValueError):
    """A ``qwenvl_policy`` stamp that cannot be read."""


def run_stamp(policy: ResizePolicy, family: str, video: VideoPolicy | None = None,
              frame_list_fps: float | None = None) -> Stamp:
    """What a dataset must be stamped with to train under ``policy`` (and ``video``, with frame lists read at
    ``frame_list_fps``) for this model family."""
    return Stamp(policy, FAMILIES[family].coords, family, video=video, frame_list_fps=frame_list_fps)


def differences(data: Stamp, run: Stamp) -> list[str]:
    """Human-readable list of the fields in which a dataset stamp disagrees with the run."""
    out = []
    for name in ("min_pixels", "max_pixels", "factor"):
        a, b = getattr(data.policy, name), getattr(run.policy, name)
        if a != b:
            out.append(f"{name}: dataset {a} vs run {b}")
    if data.coords != run.coords:
        out.append(f"coords: dataset {data.coords} vs run {run.coords} (model family {run.family})")
    if data.video is not None and run.video is not None:  # a dataset without videos has no video frame to differ
        for name, a in data.video.to_dict().items():
            b = getattr(run.video, name)
            if a != b:
                out.append(f"video {name}: dataset {a} vs run {b}")
    if data.frame_list_fps is not None and run.frame_list_fps is not None and data.frame_list_fps != run.frame_list_fps:
        out.append(f"frame_list_fps: dataset {data.frame_list_fps:g} vs run {run.frame_list_fps:g} (the frame lists' "
                   "times, and every label's time, follow from it)")
    return out


def read_dataset_info(dataset_dir: str | os.PathLike) -> dict[str, Any]:
    """The registry as a dict ({} when absent); ValueError naming the file when it is not a JSON object."""
    path = Path(dataset_dir, "dataset_info.json")
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or remove it") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path} holds a JSON {type(info).__name__}, not an object of dataset entries; fix or "
                         "remove it")
    return info


def stamp_of(entry: dict[str, Any]) -> Stamp | None:
    """The entry's stamp; None when it has none. A stamp that is there but not an object is a StampError: read as
    "unstamped" it would pass check and training with coordinates of an unknown frame."""
    data = entry.get(STAMP_KEY)
    if data is None:
        return None
    if not isinstance(data, dict):
        raise StampError(f"the {STAMP_KEY} stamp {data!r} is not an object of min_pixels, max_pixels, factor and "
                         "coords; convert the data again with qwenvl-prep convert")
    return Stamp.from_dict(data)


