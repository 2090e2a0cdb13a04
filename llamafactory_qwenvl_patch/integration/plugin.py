"""LLaMA-Factory multimodal plugins whose still images follow the pinned resize policy and whose videos follow the
pinned video policy (``video_plugin``).

Subclasses, never class patches: patching ``Qwen2VLPlugin`` itself would leak into GLM4V, Omni and Qwen3 plugins and
keep stale ``datasets`` cache fingerprints. The bounds are dataclass fields, so they are part of the fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from llamafactory_qwenvl_patch.frame.families import DEFAULT_FACTOR
from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.image_io.image_cache import process_cache
from llamafactory_qwenvl_patch.image_io.images import model_input_image, model_input_size
from llamafactory_qwenvl_patch.integration import lf_compat
from llamafactory_qwenvl_patch.integration.video_plugin import PinnedVideos, PinnedVideoStamps

_mm_plugin = lf_compat.require_module("llamafactory.data.mm_plugin", ["Qwen2VLPlugin", "Qwen3VLPlugin"])


@dataclass
class _PinnedStills:
    """Mixin: still images go through ``fetch_image`` with pinned bounds (video frames: ``video_plugin``), kept across
    epochs up to ``qwenvl_image_cache_mb`` megabytes a process (``image_cache``; 0: made on every draw)."""

    qwenvl_min_pixels: int = 0
    qwenvl_max_pixels: int = 0
    qwenvl_factor: int = DEFAULT_FACTOR
    qwenvl_image_cache_mb: int = 0

    @property
    def policy(self) -> ResizePolicy:
        return ResizePolicy(self.qwenvl_min_pixels, self.qwenvl_max_pixels, self.qwenvl_factor)

    def _regularize_images(self, images: list[Any], **kwargs: Any) -> dict[str, Any]:
        policy, cache = self.policy, process_cache(self.qwenvl_image_cache_mb)
        return {"images": [cache.image(image, policy, model_input_image) for image in images]}

    def _get_mm_token_metadata(self, images: list[Any], videos: list[Any], audios: list[Any], processor: Any
                               ) -> dict[str, Any] | None:
        """Token counts without pixels: LF 0.9.5 made every image's pixels (decoded, resized, normalised) to count
        its tokens while tokenizing a dataset, then made them again in the collator. Where the image processor keeps
        every frame-sized image as it is (``_keeps_the_frames``), the grid is the frame's, from the header
        (``model_input_size``); otherwise it comes from the pixels."""
        import torch

        tokens = super()._get_mm_token_metadata([], videos, audios, processor)
        if tokens is None or not images:
            return tokens
        sizes = [model_input_size(image, self.policy) for image in images]
        if not self._keeps_the_frames(processor.image_processor, sizes):
            return {**tokens, "image_grid_thw": self._get_mm_inputs(images, [], [], processor)["image_grid_thw"]}
        patch = self.policy.patch_size
        grid = [[1, h // patch, w // patch] for h, w in sizes]
        return {**tokens, "image_grid_thw": torch.tensor(grid, dtype=torch.long)}

    def _keeps_the_frames(self, image_processor: Any, sizes: list[tuple[int, int]]) -> bool:
        """The processor keeps each frame-sized image as it is: its bounds are the policy's (in ``size``, and in the
        ``min_pixels`` / ``max_pixels`` that transformers 4.57's processors resize with where set), and under them
        its own resize (``get_number_of_image_patches``) leaves the frame whole. A frame outside its own bounds
        (``smart_resize`` rounds up past ``max_pixels`` when the bounds are close, as in the fields demo's first
        curriculum stage at min = max) is resized a second time, so its tokens come from the pixels."""
        try:
            same = ResizePolicy.from_processor(image_processor) == self.policy
        except (PolicyError, AttributeError, TypeError, ValueError):
            return False
        patches, patch = getattr(image_processor, "get_number_of_image_patches", None), self.policy.patch_size
        return (same and patches is not None
                and all(getattr(image_processor, name, None) in (None, value) for name, value
                        in (("min_pixels", self.policy.min_pixels), ("max_pixels", self.policy.max_pixels)))
                and all(patches(h, w, {}) == (h // patch) * (w // patch) for h, w in sizes))


@dataclass
class PinnedQwen2VLPlugin(_PinnedStills, PinnedVideos, _mm_plugin.Qwen2VLPlugin):
    """Qwen2-VL / Qwen2.5-VL (factor 28)."""


@dataclass
class PinnedQwen3VLPlugin(_PinnedStills, PinnedVideoStamps, _mm_plugin.Qwen3VLPlugin):
    """Qwen3-VL and Qwen3.5 (factor 32)."""


_PINNED = {_mm_plugin.Qwen2VLPlugin: PinnedQwen2VLPlugin, _mm_plugin.Qwen3VLPlugin: PinnedQwen3VLPlugin}


def pinned_plugin(plugin: Any, policy: ResizePolicy, video: VideoPolicy, frame_list_fps: float,
                  image_cache_mb: int = 0) -> Any:
    """A new plugin instance equal to ``plugin`` but with pinned still-image bounds and video policy."""
    base = type(plugin)
    if isinstance(plugin, _PinnedStills):
        base = next(cls for cls in base.__mro__[1:] if cls in _PINNED)
    if base not in _PINNED:
        raise ValueError(
            f"qwenvl_patch: true supports templates whose plugin is Qwen2VLPlugin or Qwen3VLPlugin "
            f"(qwen2_vl, qwen3_vl, ...); this template uses {base.__name__}"
        )
    state = {f.name: getattr(plugin, f.name) for f in fields(plugin) if f.init}
    state.update(
        qwenvl_min_pixels=policy.min_pixels, qwenvl_max_pixels=policy.max_pixels, qwenvl_factor=policy.factor,
        qwenvl_video_min_pixels=video.min_pixels, qwenvl_video_max_pixels=video.max_pixels,
        qwenvl_video_fps=video.fps, qwenvl_video_maxlen=video.max_frames, qwenvl_video_clock=video.clock,
        qwenvl_frame_list_fps=frame_list_fps, qwenvl_image_cache_mb=image_cache_mb,
    )
    return _PINNED[base](**state)
