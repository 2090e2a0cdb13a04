"""Up-front clip check of a pinned training run, beside the image check (``preflight``): every clip of LF's aligned
dataset is probed as the pinned plugin will read it, before the model loads, and each bad one is named by sample and
clip in the same list as the images.

The probe is cheap (packets, and the first frame for its display rotation): it names a missing, empty (0 bytes) or
non-regular clip, one that does not open or is cut short, one whose first frame does not decode, and one the video
policy cannot size. Without it, LF stops at a ``datasets.map`` traceback, one clip per attempt. A clip whose later
frames are damaged passes the probe and fails in the collator at its batch; ``qwenvl_preflight_decode_videos: true``
decodes every clip's sampled frames here instead (as long as the collator will take over the whole dataset). Clips
stored rotated are returned as notes: training reads their stored frames, which is right for labels made on them.
An error the plugin does not expect from one clip (a bug) is that clip's problem, named with its type and place, so
the list of the others is not lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from llamafactory_qwenvl_patch.frame.policy import PolicyError
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.image_io.images import ImageError, describe
from llamafactory_qwenvl_patch.image_io.video import (
    DisplayMatrix,
    clip_name,
    display_matrix,
    is_frame_list,
    probe,
    read_clip,
    unexpected_read_problem,
)


@dataclass(frozen=True)
class VideoCheck:
    """How the run reads clips: its video policy, the rate of its frame lists, and whether the pre-flight decodes
    the sampled frames (``qwenvl_preflight_decode_videos``)."""

    policy: VideoPolicy
    frame_list_fps: float
    decode: bool = False


@dataclass(frozen=True)
class ClipResult:
    """One clip's outcome: why it cannot be used (None: it can), and how players show it (its display matrix)."""

    problem: str | None
    display: DisplayMatrix = DisplayMatrix()


def check_clip(video: Any, check: VideoCheck, located: Callable[[Any], str | None]) -> ClipResult:
    """Probe one clip (a file or a frame list) as the plugin reads it; ``located`` names a path LF resolved to
    another file than the one the dataset meant (``preflight.lf_path_problem``)."""
    for path in (video if is_frame_list(video) else [video]):
        problem = located(path)
        if problem is not None:
            return ClipResult(problem)
    try:
        clip = probe(video, check.frame_list_fps)
        clip.plan(check.policy)
        display = display_matrix(video)
        if check.decode:
            read_clip(video, check.policy, check.frame_list_fps, clip=clip)
    except (ImageError, PolicyError) as exc:
        return ClipResult(str(exc))
    except Exception as exc:  # noqa: BLE001 - one clip's unforeseen error must not lose the other samples' list
        return ClipResult(unexpected_read_problem(clip_name(video), exc))
    return ClipResult(None, display)


def clip_key(video: Any) -> Any:
    """A clip's identity in a dataset (a frame list's paths as a tuple), so a clip asked about by many samples is
    checked once."""
    return tuple(describe(frame) for frame in video) if is_frame_list(video) else describe(video)


def rotation_note(video: Any, display: DisplayMatrix) -> str:
    how = "mirrored" if display.mirrored else "rotated"
    fix = ("flip it yourself, or keep it as stored" if display.mirrored else
           "qwenvl-prep convert --video-rotation bake writes an upright copy")
    return (f"video {describe(video)}: stored {how}, players {display.in_words()} (its display matrix); training "
            f"reads the stored frames, so its labels must be on them ({fix})")
