"""The drift audit: what stock LLaMA-Factory 0.9.5 (without the plugin) would feed the encoder, and how far that
puts labels converted for the pinned frame. Only ``qwenvl-prep check``, the drift benchmark and tests need it; the
policy core does not."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from llamafactory_qwenvl_patch.frame.policy import (
    HUB_PROCESSOR_MAX_PIXELS,
    HUB_PROCESSOR_MIN_PIXELS,
    MAX_ASPECT_RATIO,
    ResizePolicy,
    map_coords,
)
from llamafactory_qwenvl_patch.frame.policy_record import read_processor_bounds


def stock_llamafactory_size(
    height: int,
    width: int,
    image_min_pixels: int = 32 * 32,
    image_max_pixels: int = 768 * 768,
    processor_min_pixels: int = HUB_PROCESSOR_MIN_PIXELS,
    processor_max_pixels: int = HUB_PROCESSOR_MAX_PIXELS,
    factor: int = 28,
) -> tuple[int, int]:
    """(height, width) that stock LLaMA-Factory 0.9.5 feeds the encoder.

    LF scales the area into [image_min_pixels, image_max_pixels] with ``int()`` truncation, forces each side to at
    least 28, squashes ratios over 200 to 180:1, then the HF processor applies its own ``smart_resize``.
    """
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

    w, h = width, height
    if w * h > image_max_pixels:
        scale = math.sqrt(image_max_pixels / (w * h))
        w, h = int(w * scale), int(h * scale)
    if w * h < image_min_pixels:
        scale = math.sqrt(image_min_pixels / (w * h))
        w, h = int(w * scale), int(h * scale)
    if min(w, h) < 28:
        w, h = max(w, 28), max(h, 28)
    if w / h > MAX_ASPECT_RATIO:
        w = h * 180
    if h / w > MAX_ASPECT_RATIO:
        h = w * 180
    return tuple(hf_smart_resize(h, w, factor=factor, min_pixels=processor_min_pixels, max_pixels=processor_max_pixels))


def processor_bounds(model: str | None) -> tuple[int, int]:
    """The base model's own processor bounds (what stock LF's second resize uses), hub defaults otherwise."""
    return (read_processor_bounds(model) if model else None) or (HUB_PROCESSOR_MIN_PIXELS, HUB_PROCESSOR_MAX_PIXELS)


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
