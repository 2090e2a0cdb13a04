"""The video policy: every video frame's size, which frames are sampled, at what real times, and the time each frame
group carries on the model's clock. The only place this math lives; LF's video path, ``qwenvl-prep`` and the
rewards ask it.

Decisions, and their sources:

- **Frame size.** Each frame is resized like a still image with the video bounds (``video_min_pixels``,
  ``video_max_pixels``): ``smart_resize`` per frame, through ``ResizePolicy``. So box labels in video frames convert
  with the same function as for images, and the HF video processor is told not to resize again.
- **No total pixel budget.** transformers' Qwen3-VL video processor and qwen-vl-utils' ``fetch_video`` shrink
  every frame to fit a budget over all frames (``t*h*w``; qwen-vl-utils' depends on ``MODEL_SEQ_LEN`` too), so a
  clip's frame would depend on its length and a box label on how long the clip runs. Here the frame depends on the
  clip's size only; the token count is bounded by ``video_max_pixels`` x ``video_maxlen`` (LF's own keys, both per
  run), which ``frame_tokens`` and ``tokens`` give before anything is decoded.
- **Sampling at real times.** Frame ``k`` is the frame on screen at ``k / rate`` seconds (from the container's
  presentation times, never from a header's frame count or rate, which webm and mkv leave empty and variable-rate
  clips get wrong); ``rate`` is ``video_fps`` unless the clip needs more than ``video_maxlen`` frames at it, and
  never above the clip's own rate (a 1-fps frame list is sampled at 1 fps, each frame once).
- **Qwen2.5-VL's clock** (``clock="seconds"``): M-RoPE places frame group ``g`` at ``g * second_per_grid_ts *
  tokens_per_second``, and transformers 5.6 (and every 4.x) truncate ``second_per_grid_ts`` to an integer
  (``modeling_qwen2_5_vl.get_rope_index``). The rate is therefore always ``temporal_patch / k`` for a whole ``k``
  (2, 1, 0.667, 0.5 ... fps): ``second_per_grid_ts = k`` is the same number before and after the truncation, so
  every reader places each group at its real start time. A long clip steps to the next such rate instead of
  dropping to ``video_maxlen / duration``.
- **Qwen3-VL / Qwen3.5's clock** (``clock="stamps"``): the only time signal is the text stamp ``<t seconds>`` before
  each group, the mean time of its frames (``Qwen3VLProcessor._calculate_timestamps``); any rate works, so a long clip
  gets ``video_maxlen`` frames spread over it.
- **Qwen2-VL** (``clock="index"``): M-RoPE counts groups, with no time; it samples like Qwen3.
- **Even frame counts.** Frames go to the encoder in pairs (``temporal_patch`` 2): an odd count repeats its last
  frame, as LF and transformers do, and ``video_maxlen`` is rounded down to even so the padded count never passes it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from llamafactory_qwenvl_patch.frame.families import DEFAULT_FACTOR, LF_VIDEO_DEFAULTS, TEMPORAL_PATCH
from llamafactory_qwenvl_patch.frame.keys import frame_key
from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy

METADATA_FPS = 1.0  # the ``fps`` handed with ``VideoPlan.frames_indices`` (which are then seconds)
MIN_FPS, MAX_FPS = 1e-3, 1000.0  # sampling and frame-list rates outside are typos (1e-320 overflowed the clock)
CLOCKS = ("seconds", "stamps", "index")
# A clip's sampled times are compared with presentation times that containers round to their time base (1/1000 s in
# webm): a frame due at 0.5 s may carry 0.49999. This tolerance keeps such a frame on time.
TIME_EPSILON = 1e-6
MAX_FRAMES_LIMIT = 100_000  # far beyond any real video_maxlen; a bigger one is a typo that would exhaust memory


class VideoError(PolicyError):
    """A clip the video policy cannot sample (empty, no frames, a non-finite duration); the message names it."""


@dataclass(frozen=True)
class VideoPolicy:
    """Pinned video bounds and sampling: the same numbers drive conversion, training, export and serving."""

    min_pixels: int
    max_pixels: int
    factor: int = DEFAULT_FACTOR
    fps: float = LF_VIDEO_DEFAULTS["video_fps"]
    max_frames: int = LF_VIDEO_DEFAULTS["video_maxlen"]
    clock: str = "seconds"

    def __post_init__(self) -> None:
        ResizePolicy(self.min_pixels, self.max_pixels, self.factor)  # the same bounds checks as for images
        if not (isinstance(self.fps, (int, float)) and MIN_FPS <= self.fps <= MAX_FPS):
            raise PolicyError(f"video_fps must be a number from {MIN_FPS:g} to {MAX_FPS:g}, got {self.fps!r}")
        if not isinstance(self.max_frames, int) or not TEMPORAL_PATCH <= self.max_frames <= MAX_FRAMES_LIMIT:
            raise PolicyError(f"video_maxlen must be an integer from {TEMPORAL_PATCH} to {MAX_FRAMES_LIMIT}, got "
                              f"{self.max_frames!r}")
        if self.clock not in CLOCKS:
            raise PolicyError(f"unknown video clock {self.clock!r}; expected one of {', '.join(CLOCKS)}")

    @classmethod
    def from_lf_keys(cls, keys: dict[str, object], factor: int, clock: str) -> "VideoPolicy":
        """The policy of LF's video keys (``video_min_pixels``, ``video_max_pixels``, ``video_fps``,
        ``video_maxlen``; LF's defaults for those missing) for a family's factor and clock; each value as LF uses it
        (``frame_key``: ``1.6e4`` is 16000, a null or a quoted number a FrameKeyError naming the key)."""
        values = {key: frame_key(key, keys.get(key, default)) for key, default in LF_VIDEO_DEFAULTS.items()}
        return cls(values["video_min_pixels"], values["video_max_pixels"], factor, values["video_fps"],
                   values["video_maxlen"], clock)

    @property
    def frame_policy(self) -> ResizePolicy:
        """The still-image policy every frame is resized with."""
        return ResizePolicy(self.min_pixels, self.max_pixels, self.factor)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def frame_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of every frame the encoder sees, for a clip of this size (``smart_resize``)."""
        return self.frame_policy.model_size(height, width)

    def frame_tokens(self, height: int, width: int) -> int:
        """``<|video_pad|>`` tokens of one frame group."""
        return self.frame_policy.image_tokens(height, width)

    @property
    def frame_cap(self) -> int:
        """The most frames sampled from one clip, padding included (``video_maxlen`` rounded down to even)."""
        return self.max_frames - self.max_frames % TEMPORAL_PATCH

    def rate(self, duration: float, source_fps: float = math.inf) -> float:
        """Frames per second sampled from a clip of ``duration`` seconds whose own rate is ``source_fps``: ``video_fps``
        (never above the clip's own rate: no frame twice) while the clip fits in ``video_maxlen`` frames at it;
        under ``clock="seconds"`` the highest ``2 / k`` at most that (so at most 2) that fits."""
        return 1.0 / self.interval(duration, source_fps)

    def interval(self, duration: float, source_fps: float = math.inf) -> float:
        """Seconds between sampled frames (``1 / rate``); exactly ``k / 2`` under ``clock="seconds"``, so that
        ``second_per_grid_ts`` is the whole number ``k`` without a float rounding below it."""
        duration = _check_duration(duration)
        wanted = min(float(self.fps), source_fps)
        if self.clock == "seconds":
            step = max(1, math.ceil(TEMPORAL_PATCH / wanted - TIME_EPSILON))
            step = max(step, math.ceil(duration * TEMPORAL_PATCH / self.frame_cap - TIME_EPSILON))
            while _count(duration, step / TEMPORAL_PATCH) > self.frame_cap:  # float rounding at the boundary
                step += 1
            return step / TEMPORAL_PATCH
        if _count(duration, 1.0 / wanted) <= self.frame_cap:
            return 1.0 / wanted
        return duration / self.frame_cap

    def plan(self, frame_times: Sequence[float], duration: float | None = None) -> "VideoPlan":
        """Which of a clip's frames are sampled, given each frame's presentation time in seconds from the first
        (sorted), and the clip's duration (default: one frame interval past the last frame)."""
        times = [float(t) for t in frame_times]
        if not times:
            raise VideoError("the clip has no frames")
        if not all(math.isfinite(t) for t in times) or any(b < a for a, b in zip(times, times[1:])):
            raise VideoError("the clip's frame times are not finite and increasing")
        if duration is None:
            duration = clip_duration(times)
        source_fps = len(times) / duration if duration > 0 else math.inf
        interval = self.interval(duration, source_fps)
        count = min(_count(duration, interval), self.frame_cap)
        sampled = [k * interval for k in range(count)]
        indices = [max(0, bisect.bisect_right(times, t + TIME_EPSILON) - 1) for t in sampled]
        if count % TEMPORAL_PATCH:
            indices.append(indices[-1])
            sampled.append(sampled[-1])
        return VideoPlan(tuple(indices), tuple(sampled), interval, duration, self.clock)


@dataclass(frozen=True)
class VideoPlan:
    """One clip under the policy: the container frames to decode (by index, padded to even), the real time of each
    sampled frame, and what follows for the model's clock."""

    indices: tuple[int, ...]
    times: tuple[float, ...]
    interval: float  # seconds between sampled frames
    duration: float
    clock: str

    @property
    def rate(self) -> float:
        """Sampled frames per second (``video_metadata.fps`` / ``sampled_fps``)."""
        return 1.0 / self.interval

    @property
    def groups(self) -> int:
        """Temporal groups (``video_grid_thw[0]``)."""
        return len(self.indices) // TEMPORAL_PATCH

    @property
    def second_per_grid_ts(self) -> float:
        """Seconds per frame group, as Qwen2.5-VL's processor computes it (``temporal_patch / sampled fps``); a whole
        number under ``clock="seconds"``."""
        return TEMPORAL_PATCH * self.interval

    @property
    def group_starts(self) -> list[float]:
        """Real time of each group's first frame: where Qwen2.5-VL's M-RoPE puts the group (in seconds)."""
        return [self.times[g * TEMPORAL_PATCH] for g in range(self.groups)]

    @property
    def stamps(self) -> list[float]:
        """Qwen3-VL / Qwen3.5's ``<t seconds>`` of each group: the mean time of its frames."""
        return [sum(self.times[g * TEMPORAL_PATCH:(g + 1) * TEMPORAL_PATCH]) / TEMPORAL_PATCH
                for g in range(self.groups)]

    @property
    def stamp_texts(self) -> list[str]:
        """Each group's stamp as LF's Qwen3-VL plugin writes it before the group's vision tokens (one decimal)."""
        return [f"<{stamp:.1f} seconds>" for stamp in self.stamps]

    @property
    def frames_indices(self) -> list[float]:
        """``video_metadata.frames_indices`` for transformers' Qwen3-VL processor, given with ``fps`` =
        ``METADATA_FPS``: the sampled times themselves, so its stamps (each index over fps, each pair's mean) are
        ``stamps`` bit for bit (indices scaled by the rate round differently: 16.6 s printed 16.7)."""
        return list(self.times)

    def metadata(self, frames: int) -> dict[str, Any]:
        """The clip's ``video_metadata`` for a processor (transformers' or vLLM's) given its ``frames`` sampled frames,
        not to be sampled again. The Qwen3 clock: the plan's times as ``frames_indices`` at ``METADATA_FPS`` (the
        stamps). Qwen2.5-VL's: the sampled rate as ``fps`` over every frame, so the processor's ``second_per_grid_ts``
        (``temporal_patch / sampled_fps``) is the plan's whole number exactly (Qwen2-VL has no clock: the same)."""
        if self.clock == "stamps":
            return {"fps": METADATA_FPS, "frames_indices": self.frames_indices, "total_num_frames": frames,
                    "duration": self.duration}
        return {"fps": self.rate, "frames_indices": list(range(frames)), "total_num_frames": frames,
                "duration": self.duration}

    def vllm_item(self, frames: Any) -> tuple[Any, dict[str, Any]]:
        """vLLM's ``multi_modal_data["video"]`` item for this plan's decoded ``frames`` ((T, H, W, 3) array): the
        frames and the plan's clock, not to be resampled."""
        return frames, {**self.metadata(len(frames)), "do_sample_frames": False}

    def tokens(self, frame_tokens: int) -> int:
        """``<|video_pad|>`` tokens of the whole clip."""
        return self.groups * frame_tokens


def video_processor_kwargs(plans: list[VideoPlan]) -> dict[str, Any]:
    """A video request's ``mm_processor_kwargs``: the frames are final (``do_resize=False``: the engine-level pixel
    bounds would otherwise become the Qwen3 video processor's budget over all frames). vLLM 0.28 hands an item's
    metadata to the HF processor for the Qwen3 models only; Qwen2-VL's and Qwen2.5-VL's processor would take 24 fps
    (``VideoMetadata.sampled_fps``'s default) and put the groups 1/12 s apart, so their plans' metadata go as the
    processor's own ``video_metadata``, one per video of the request. vLLM hashes an item with the request's kwargs
    and, on a cache hit, runs the processor on the other items with the whole list: such a request is one video,
    or runs with the processor cache off (GRPO, predict)."""
    kwargs: dict[str, Any] = {"do_resize": False}
    if any(plan.clock != "stamps" for plan in plans):
        kwargs["video_metadata"] = [plan.metadata(len(plan.indices)) for plan in plans]  # frames, padding included
    return kwargs


def clip_duration(frame_times: Sequence[float]) -> float:
    """A clip's length from its frames' presentation times: the last frame lasts as long as the median interval
    (a single frame: one second's worth is meaningless, so it lasts 0, and one frame is sampled)."""
    if len(frame_times) < 2:
        return 0.0
    gaps = sorted(b - a for a, b in zip(frame_times, frame_times[1:]))
    return float(frame_times[-1] + gaps[len(gaps) // 2])


def frame_list_times(count: int, fps: float) -> list[float]:
    """Presentation times of a pre-extracted frame list taken at ``fps`` frames per second."""
    if not (isinstance(fps, (int, float)) and MIN_FPS <= fps <= MAX_FPS):
        raise VideoError(f"a frame list's rate must be a number from {MIN_FPS:g} to {MAX_FPS:g}, got {fps!r}")
    return [k / fps for k in range(count)]


def _check_duration(duration: float) -> float:
    if not isinstance(duration, (int, float)) or not math.isfinite(duration) or duration < 0:
        raise VideoError(f"clip duration {duration!r} is not a finite number of seconds >= 0")
    return float(duration)


def _count(duration: float, interval: float) -> int:
    """Frames at 0, interval, 2 interval, ... before the clip ends (at least one)."""
    return max(1, math.ceil(duration / interval - TIME_EPSILON))
