"""The resize policy core: the only place that computes model-input sizes and coordinate mappings.

Every other part of the package (the LLaMA-Factory plugin, ``qwenvl-prep``, rewards, evaluation) calls into this
module. A second copy of this math is how label/model frame drift comes back, so do not re-derive any of it elsewhere.

Frames are ``(height, width)`` tuples; coordinates are flat ``[x, y, x, y, ...]`` sequences (a box is two points).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

from llamafactory_qwenvl_patch.frame.families import DEFAULT_FACTOR, MERGE_SIZE

MAX_ASPECT_RATIO = 200

# Coordinate conventions: ``orig`` original-image pixels, ``model`` absolute pixels of the resized model input
# (Qwen2.5-VL), ``rel1000`` relative 0-1000 (Qwen2-VL, Qwen3-VL), ``rel1`` relative 0-1.
CONVENTIONS: tuple[str, ...] = ("orig", "model", "rel1000", "rel1")
_REL_SCALE = {"rel1000": 1000.0, "rel1": 1.0}



class PolicyError(ValueError):
    """An image or coordinate that the policy cannot represent (the message names the offending size or value)."""


@dataclass(frozen=True)
class ResizePolicy:
    """Pinned resize bounds: the same numbers drive data conversion, training, export and inference."""

    min_pixels: int
    max_pixels: int
    factor: int = DEFAULT_FACTOR

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.factor % MERGE_SIZE:
            raise PolicyError(f"factor must be a positive multiple of {MERGE_SIZE}, got {self.factor}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise PolicyError(
                f"need 0 < min_pixels <= max_pixels, got min_pixels={self.min_pixels}, max_pixels={self.max_pixels}"
            )

    @property
    def patch_size(self) -> int:
        """Vision patch size (14 for Qwen2/2.5-VL, 16 for Qwen3-VL): what ``fetch_image`` calls image_patch_size."""
        return self.factor // MERGE_SIZE

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def model_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the image the vision encoder sees, exactly as ``qwen_vl_utils.smart_resize`` computes.

        Raises PolicyError for sizes the HF processor would reject, including ratios that cross 200 only after
        rounding (29x5771 -> 28x5768), so the failure happens up front with the image size in the message.
        """
        return _model_size(self, height, width)

    def image_tokens(self, height: int, width: int) -> int:
        """Number of ``<|image_pad|>`` tokens for one image of this original size."""
        out_h, out_w = self.model_size(height, width)
        return (out_h // self.factor) * (out_w // self.factor)

    def size_from_grid(self, grid_thw: Sequence[int]) -> tuple[int, int]:
        """(height, width) in pixels of the image the processor encoded, from its ``image_grid_thw`` row (counted
        in vision patches)."""
        return int(grid_thw[1]) * self.patch_size, int(grid_thw[2]) * self.patch_size

    @classmethod
    def from_processor(cls, image_processor: Any, min_pixels: int | None = None,
                       max_pixels: int | None = None) -> "ResizePolicy":
        """The policy an HF image processor applies: its factor (patch size x merge size) and its bounds, unless
        other bounds are given (pinning a run's bounds onto a processor)."""
        factor = int(image_processor.patch_size) * int(image_processor.merge_size)
        size = getattr(image_processor, "size", None) or {}
        low = min_pixels if min_pixels is not None else size.get("shortest_edge")
        high = max_pixels if max_pixels is not None else size.get("longest_edge")
        if low is None or high is None:
            raise PolicyError(f"{type(image_processor).__name__} has no pixel bounds (size: {size!r}); pin them "
                              f"with image_min_pixels / image_max_pixels")
        return cls(int(low), int(high), factor)


@lru_cache(maxsize=1)
def load_backend() -> Callable:
    """qwen-vl-utils' ``smart_resize``, loaded once (forked workers inherit it), without torch when possible."""
    from llamafactory_qwenvl_patch.frame.smart_resize_source import load_smart_resize

    return load_smart_resize()


@lru_cache(maxsize=65536)
def _model_size(policy: ResizePolicy, height: int, width: int) -> tuple[int, int]:
    """Cached: datasets repeat a few camera and screen sizes, and convert asks once per record."""
    smart_resize = load_backend()
    if height <= 0 or width <= 0:
        raise PolicyError(f"image size {width}x{height} (WxH) is empty")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise PolicyError(
            f"image size {width}x{height} (WxH) has aspect ratio {ratio:.1f}, over the limit of {MAX_ASPECT_RATIO}"
        )
    out_h, out_w = smart_resize(
        height, width, factor=policy.factor, min_pixels=policy.min_pixels, max_pixels=policy.max_pixels
    )
    if min(out_h, out_w) < policy.factor:  # a thin image under a small max_pixels: smart_resize floors a side to 0
        raise PolicyError(
            f"image size {width}x{height} (WxH) cannot be resized under max_pixels={policy.max_pixels}: its short "
            f"side would be {min(out_h, out_w)} px, less than one {policy.factor} px patch; raise image_max_pixels "
            "or crop the image"
        )
    out_ratio = max(out_h, out_w) / min(out_h, out_w)
    if out_ratio > MAX_ASPECT_RATIO:
        raise PolicyError(
            f"image size {width}x{height} (WxH) resizes to {out_w}x{out_h} with aspect ratio {out_ratio:.1f}, "
            f"over the limit of {MAX_ASPECT_RATIO} that the HF processor enforces"
        )
    return out_h, out_w


def _frame_scale(convention: str, orig_hw: tuple[int, int], model_hw: tuple[int, int]) -> tuple[float, float]:
    """(x scale, y scale): the size of the full image in this convention's units."""
    if convention == "orig":
        return float(orig_hw[1]), float(orig_hw[0])
    if convention == "model":
        return float(model_hw[1]), float(model_hw[0])
    if convention in _REL_SCALE:
        return _REL_SCALE[convention], _REL_SCALE[convention]
    raise PolicyError(f"unknown coordinate convention {convention!r}; expected one of {', '.join(CONVENTIONS)}")


def frame_extent(convention: str, orig_hw: tuple[int, int], model_hw: tuple[int, int]) -> tuple[float, float]:
    """(width, height) of the whole image in a convention's units: what "covers the whole image" means there."""
    return _frame_scale(convention, orig_hw, model_hw)


def map_coords(
    coords: Sequence[float],
    src: str,
    dst: str,
    orig_hw: tuple[int, int],
    model_hw: tuple[int, int],
) -> list[float]:
    """Map flat x, y coordinates between conventions in float (no rounding; see ``finalize_coords``)."""
    if len(coords) % 2:
        raise PolicyError(f"coordinates must come in x, y pairs, got {len(coords)} values")
    if not all(map(math.isfinite, coords)):
        raise PolicyError(f"coordinates {list(coords)} are not all finite numbers")
    src_x, src_y = _frame_scale(src, orig_hw, model_hw)
    dst_x, dst_y = _frame_scale(dst, orig_hw, model_hw)
    fx, fy = dst_x / src_x, dst_y / src_y
    out: list[float] = []
    for i in range(0, len(coords), 2):
        out += (coords[i] * fx, coords[i + 1] * fy)
    return out


def finalize_coords(
    coords: Sequence[float],
    convention: str,
    orig_hw: tuple[int, int],
    model_hw: tuple[int, int],
    ndigits: int | None = 0,
) -> list[float] | list[int]:
    """Round once (``ndigits=0`` gives ints, ``None`` keeps floats) and clamp into the convention's frame."""
    max_x, max_y = _frame_scale(convention, orig_hw, model_hw)
    out: list = []
    for i, value in enumerate(coords):
        limit = max_x if i % 2 == 0 else max_y
        value = min(max(value, 0.0), limit)
        if ndigits == 0:
            out.append(int(round(value)))
        elif ndigits is None:
            out.append(value)
        else:
            out.append(round(value, ndigits))
    return out


def convert_coords(
    coords: Sequence[float],
    src: str,
    dst: str,
    orig_hw: tuple[int, int],
    model_hw: tuple[int, int],
    ndigits: int | None = 0,
) -> list[float] | list[int]:
    """Map then round once and clamp: the one call for turning labels or predictions into another frame."""
    return finalize_coords(map_coords(coords, src, dst, orig_hw, model_hw), dst, orig_hw, model_hw, ndigits)


def retarget_coords(
    coords: Sequence[float],
    src: str,
    src_hw: tuple[int, int],
    dst: str,
    dst_hw: tuple[int, int],
    orig_hw: tuple[int, int],
    ndigits: int | None = 0,
) -> list[float] | list[int]:
    """Coordinates labelled in one policy's frame (``src`` convention, model size ``src_hw``) moved to another
    policy's (``dst``, ``dst_hw``) through the original image, rounding once: re-converting a stamped dataset for new
    bounds, or a curriculum stage's labels for the next stage."""
    if src_hw == dst_hw:
        return convert_coords(coords, src, dst, orig_hw, dst_hw, ndigits)
    return convert_coords(map_coords(coords, src, "orig", orig_hw, src_hw), "orig", dst, orig_hw, dst_hw, ndigits)


def keep_extent(box: Sequence[int], convention: str, orig_hw: tuple[int, int], model_hw: tuple[int, int]
                ) -> list[int]:
    """A rounded box with at least one unit of extent per axis: a valid 1-3 px box on a 4032x3024 photo rounds to
    zero width in a 28-px-multiple frame, which no check, loss or IoU can use. The lost unit is added away from the
    frame's edge."""
    out = list(box)
    for axis, limit in zip((0, 1), _frame_scale(convention, orig_hw, model_hw)):
        low, high = out[axis], out[axis + 2]
        if high - low < 1:
            if low + 1 <= limit:
                out[axis + 2] = low + 1
            else:
                out[axis] = high - 1
    return out


def check_box(box: Sequence[float], convention: str, orig_hw: tuple[int, int], model_hw: tuple[int, int]) -> None:
    """Raise PolicyError for a box that is not finite, inverted, empty or outside its frame."""
    if len(box) != 4:
        raise PolicyError(f"box {list(box)} must have 4 values [x1, y1, x2, y2]")
    for value in box:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PolicyError(f"box {list(box)} has a non-finite value {value!r}")
    x1, y1, x2, y2 = box
    if x2 <= x1 or y2 <= y1:
        raise PolicyError(f"box {list(box)} is inverted or has zero area (need x1 < x2 and y1 < y2)")
    max_x, max_y = _frame_scale(convention, orig_hw, model_hw)
    if x1 < 0 or y1 < 0 or x2 > max_x or y2 > max_y:
        raise PolicyError(f"box {list(box)} lies outside the {convention} frame {max_x:g}x{max_y:g} (WxH)")


def check_point(point: Sequence[float], convention: str, orig_hw: tuple[int, int], model_hw: tuple[int, int]) -> None:
    """Raise PolicyError for a point that is not finite or outside its frame."""
    if len(point) != 2:
        raise PolicyError(f"point {list(point)} must have 2 values [x, y]")
    for value in point:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PolicyError(f"point {list(point)} has a non-finite value {value!r}")
    max_x, max_y = _frame_scale(convention, orig_hw, model_hw)
    if not (0 <= point[0] <= max_x and 0 <= point[1] <= max_y):
        raise PolicyError(f"point {list(point)} lies outside the {convention} frame {max_x:g}x{max_y:g} (WxH)")
