"""The drift audit: what stock LLaMA-Factory 0.9.5 (without the plugin) would feed the encoder, and how far that
puts labels converted for the pinned frame; for videos also which frames it samples and the times the model reads
for them. Only ``qwenvl-prep check``, the drift benchmarks and tests need it; the policy core does not."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from llamafactory_qwenvl_patch.frame.families import (
    DEFAULT,
    DEFAULT_FACTOR,
    FAMILIES,
    LF_IMAGE_DEFAULTS,
    LF_MIN_SIDE,
    LF_VIDEO_DEFAULTS,
    TEMPORAL_PATCH,
)
from llamafactory_qwenvl_patch.frame.policy import MAX_ASPECT_RATIO, ResizePolicy, map_coords
from llamafactory_qwenvl_patch.frame.policy_record import read_processor_bounds

_DEFAULT_HUB = FAMILIES[DEFAULT].hub_image_bounds


def stock_llamafactory_size(
    height: int,
    width: int,
    image_min_pixels: int = LF_IMAGE_DEFAULTS["image_min_pixels"],
    image_max_pixels: int = LF_IMAGE_DEFAULTS["image_max_pixels"],
    processor_min_pixels: int = _DEFAULT_HUB[0],
    processor_max_pixels: int = _DEFAULT_HUB[1],
    factor: int = DEFAULT_FACTOR,
) -> tuple[int, int]:
    """(height, width) that stock LLaMA-Factory 0.9.5 feeds the encoder (by default: Qwen2.5-VL's hub processor).

    LF scales the area into [image_min_pixels, image_max_pixels] with ``int()`` truncation, forces each side to at
    least 28, squashes ratios over 200 to 180:1, then the HF processor applies its own ``smart_resize``.
    """
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

    h, w = lf_prefit_size(height, width, image_min_pixels, image_max_pixels)
    return tuple(hf_smart_resize(h, w, factor=factor, min_pixels=processor_min_pixels, max_pixels=processor_max_pixels))


def lf_prefit_size(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) after LF 0.9.5's own pre-fit of an image or a video frame (``BasePlugin._preprocess_image``
    then ``Qwen2VLPlugin._preprocess_image``; for frames also ``_get_qwen_video_size_after_regularization``): the
    area scaled into [min_pixels, max_pixels] with ``int()`` truncation, each side at least 28, ratios over 200
    squashed to 180:1. The HF processor resizes the result again."""
    w, h = width, height
    if w * h > max_pixels:
        scale = math.sqrt(max_pixels / (w * h))
        w, h = int(w * scale), int(h * scale)
    if w * h < min_pixels:
        scale = math.sqrt(min_pixels / (w * h))
        w, h = int(w * scale), int(h * scale)
    if min(w, h) < LF_MIN_SIDE:
        w, h = max(w, LF_MIN_SIDE), max(h, LF_MIN_SIDE)
    if w / h > MAX_ASPECT_RATIO:
        w = h * 180
    if h / w > MAX_ASPECT_RATIO:
        h = w * 180
    return h, w


@dataclass(frozen=True)
class VideoHeader:
    """What LF 0.9.5 reads of a video file (PyAV's first video stream), and how many frames decoding really yields.
    Frame ``i`` is on screen from ``i / average_rate`` (a constant-rate clip)."""

    width: int
    height: int
    frames: int  # ``stream.frames``: 0 when the header has none (webm, mkv)
    duration: float | None  # ``stream.duration * stream.time_base`` in seconds; None when the header has none
    average_rate: float  # ``stream.average_rate``
    decoded: int | None = None  # frames the file holds (default ``frames``); LF keeps only its indices below it


@dataclass(frozen=True)
class FrameList:
    """A video given as pre-extracted frames (a list of images) taken at ``fps``; LF is not told the rate."""

    width: int
    height: int
    count: int
    fps: float


@dataclass(frozen=True)
class StockVideo:
    """One clip through stock LF 0.9.5 and transformers 5.6: the frame, the frames, and the model's clock."""

    frame: tuple[int, int]  # (height, width) of every frame the encoder gets
    indices: tuple[int, ...]  # the frames decoded, before an odd count's padding
    times: tuple[float, ...]  # when each frame the encoder gets (padding included) comes on screen, in seconds
    frame_span: float  # how long each frame stays on screen (1 / the clip's own rate)
    fps_per_video: float
    second_per_grid_ts: float  # Qwen2.5-VL's ``temporal_patch / fps_per_video``
    stamps: tuple[float, ...]  # Qwen3-VL / Qwen3.5's ``<t seconds>`` of each group, before ``:.1f``

    @property
    def groups(self) -> int:
        return len(self.times) // TEMPORAL_PATCH

    @property
    def group_starts(self) -> list[float]:
        """When each group's first frame comes on screen."""
        return [self.times[g * TEMPORAL_PATCH] for g in range(self.groups)]

    @property
    def positions(self) -> list[float]:
        """Where transformers 5.6 puts each group on Qwen2.5-VL's M-RoPE clock, in seconds (``get_rope_index``:
        ``tokens_per_second * int(second_per_grid_ts)`` per group, divided by ``tokens_per_second``)."""
        return [float(g * int(self.second_per_grid_ts)) for g in range(self.groups)]

    @property
    def real_means(self) -> list[float]:
        """The mean on-screen start of each group's frames (what a Qwen3 stamp should say)."""
        return [sum(self.times[g * TEMPORAL_PATCH:(g + 1) * TEMPORAL_PATCH]) / TEMPORAL_PATCH
                for g in range(self.groups)]


def stock_llamafactory_video_indices(frames: int, duration: float | None, video_fps: float,
                                     video_maxlen: int) -> list[int]:
    """LF's ``_get_video_sample_indices``: with no frame count in the header, the first ``video_maxlen`` indices;
    else ``min(frames, video_maxlen, floor(duration * video_fps))`` spread by ``linspace`` and truncated."""
    import numpy as np

    if frames == 0:
        return np.linspace(0, video_maxlen - 1, video_maxlen).astype(np.int32).tolist()
    if duration is None:
        raise ValueError("stock LF fails on a header with a frame count but no duration (float(None * time_base))")
    count = min(frames, video_maxlen, max(1, math.floor(duration * video_fps)))
    return np.linspace(0, frames - 1, count).astype(np.int32).tolist()


def stock_llamafactory_video_frame(height: int, width: int, frames: int, family: str = DEFAULT,
                                   video_min_pixels: int = LF_VIDEO_DEFAULTS["video_min_pixels"],
                                   video_max_pixels: int = LF_VIDEO_DEFAULTS["video_max_pixels"],
                                   processor_bounds: tuple[int, int] | None = None) -> tuple[int, int]:
    """(height, width) of every frame of a clip stock LF feeds the encoder: LF's ``int()`` pre-fit to the video keys,
    then the HF video processor's ``smart_resize`` under its own bounds: per frame for Qwen2/2.5-VL, over all
    ``frames`` together (``t*h*w``, the count after padding) for Qwen3-VL and Qwen3.5."""
    fam = FAMILIES[family]
    low, high = processor_bounds or _hub_bounds(fam.hub_video_bounds, family, "video")
    h, w = lf_prefit_size(height, width, video_min_pixels, video_max_pixels)
    if not fam.video_bounds_per_frame:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as budget_resize

        return tuple(budget_resize(num_frames=frames, height=h, width=w, temporal_factor=TEMPORAL_PATCH,
                                   factor=fam.factor, min_pixels=low, max_pixels=high))
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

    return tuple(hf_smart_resize(h, w, factor=fam.factor, min_pixels=low, max_pixels=high))


def stock_llamafactory_video(clip: VideoHeader | FrameList, family: str = DEFAULT,
                             video_min_pixels: int = LF_VIDEO_DEFAULTS["video_min_pixels"],
                             video_max_pixels: int = LF_VIDEO_DEFAULTS["video_max_pixels"],
                             video_fps: float = LF_VIDEO_DEFAULTS["video_fps"],
                             video_maxlen: int = LF_VIDEO_DEFAULTS["video_maxlen"],
                             processor_bounds: tuple[int, int] | None = None) -> StockVideo:
    """A clip through ``Qwen2VLPlugin._regularize_videos`` / ``_get_mm_inputs`` (``Qwen3VLPlugin``'s for Qwen3):
    the frames sampled, each frame's size, ``second_per_grid_ts`` (``2 / (samples / header duration)``, or
    ``2 / video_fps`` without a duration and for frame lists) and Qwen3's stamps (``frames_indices`` at
    ``video_fps``: a file's index over its header rate, a frame list's plain index)."""
    if isinstance(clip, FrameList):
        sampled = list(range(clip.count))  # LF takes every frame of a list, whatever video_maxlen says
        kept, rate = sampled, float(clip.fps)
        clock = [float(i) for i in sampled]
        fps_per_video = float(video_fps)
    else:
        sampled = stock_llamafactory_video_indices(clip.frames, clip.duration, video_fps, video_maxlen)
        decoded = clip.frames if clip.decoded is None else clip.decoded
        kept, rate = [i for i in sampled if i < decoded], float(clip.average_rate)
        clock = [i / clip.average_rate * video_fps for i in sampled]
        fps_per_video = float(video_fps) if clip.duration is None else len(sampled) / clip.duration
    if not kept:
        raise ValueError("stock LF decodes no frame of this clip")
    padded = kept + kept[-1:] * (len(kept) % TEMPORAL_PATCH)
    frame = stock_llamafactory_video_frame(clip.height, clip.width, len(padded), family, video_min_pixels,
                                           video_max_pixels, processor_bounds)
    clock = clock + clock[-1:] * (len(clock) % TEMPORAL_PATCH)  # Qwen3VLProcessor._calculate_timestamps
    seconds = [t / video_fps for t in clock]
    stamps = [(seconds[i] + seconds[i + 1]) / 2 for i in range(0, len(seconds), TEMPORAL_PATCH)]
    return StockVideo(frame, tuple(kept), tuple(i / rate for i in padded), 1.0 / rate, fps_per_video,
                      TEMPORAL_PATCH / fps_per_video, tuple(stamps[:len(padded) // TEMPORAL_PATCH]))


def _hub_bounds(bounds: tuple[int, int] | None, family: str, kind: str) -> tuple[int, int]:
    if bounds is None:
        raise ValueError(f"no known hub {kind}-processor bounds for {family} (Family.hub_{kind}_bounds); pass "
                         "the model folder or processor_bounds")
    return bounds


def processor_bounds(model: str | None, family: str = DEFAULT) -> tuple[int, int]:
    """The base model's own image processor bounds (what stock LF's second resize uses), else those of ``family``'s
    hub checkpoints."""
    return (read_processor_bounds(model) if model else None) or _hub_bounds(
        FAMILIES[family].hub_image_bounds, family, "image")


@dataclass
class _Stat:
    count: int = 0
    total: float = 0.0
    largest: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.largest = max(self.largest, value)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass
class DriftAudit:
    """Running totals (constant memory) of frames stock LF changes and of the label error that causes."""

    policy: ResizePolicy
    processor: tuple[int, int]
    images: int = 0
    frames: _Stat = field(default_factory=_Stat)
    label_model: _Stat = field(default_factory=_Stat)
    label_orig: _Stat = field(default_factory=_Stat)

    def add_image(self, hw: tuple[int, int], model_hw: tuple[int, int]) -> tuple[int, int]:
        """Count one image; returns stock LF's frame for it."""
        p = self.policy
        stock_hw = stock_llamafactory_size(*hw, p.min_pixels, p.max_pixels, *self.processor, p.factor)
        self.images += 1
        if stock_hw != model_hw:
            self.frames.add(max(abs(stock_hw[0] - model_hw[0]), abs(stock_hw[1] - model_hw[1])))
        return stock_hw

    def add_label(self, coords: Sequence[float], hw: tuple[int, int], model_hw: tuple[int, int],
                  stock_hw: tuple[int, int]) -> None:
        """A label in model-frame pixels: stock LF shows a ``stock_hw`` image while it speaks of ``model_hw``."""
        if stock_hw == model_hw:
            return
        sx, sy = stock_hw[1] / model_hw[1], stock_hw[0] / model_hw[0]
        err = [abs(v * ((sx if i % 2 == 0 else sy) - 1)) for i, v in enumerate(coords)]
        self.label_model.add(max(err))
        self.label_orig.add(max(map_coords(err, "model", "orig", hw, stock_hw)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "images": self.images,
            "frames_changed": self.frames.count,
            "frames_changed_share": round(self.frames.count / self.images, 4) if self.images else 0.0,
            "frame_mean_px": round(self.frames.mean, 2),
            "frame_max_px": int(self.frames.largest),
            "label_mean_model_px": round(self.label_model.mean, 2),
            "label_max_model_px": round(self.label_model.largest, 2),
            "label_mean_orig_px": round(self.label_orig.mean, 2),
            "label_max_orig_px": round(self.label_orig.largest, 2),
            "stock_processor_bounds": list(self.processor),
        }
