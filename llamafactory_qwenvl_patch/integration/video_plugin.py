"""LLaMA-Factory's video path under the pinned video policy (``frame.video``), for the Qwen2-VL and Qwen3-VL plugins.

What it replaces in LF 0.9.5's ``Qwen2VLPlugin`` / ``Qwen3VLPlugin`` (``data/mm_plugin.py``):

- ``_regularize_videos``: frames sampled at their real times for every container (LF took the first
  ``video_maxlen`` frames of a webm or mkv, whose header has no frame count), resized once to the policy's frame (LF
  pre-scaled with ``int()`` and the HF video processor resized again under its own bounds);
- ``_get_video_token_metadata``: the grid and each video's own clock from the packets, without decoding;
- ``_get_mm_inputs``: the video processor told not to resize (``do_resize=False``), Qwen3's metadata per video, and
  Qwen2.5-VL's ``second_per_grid_ts`` from the policy (a whole number: see ``frame.video``);
- ``process_messages`` (Qwen3 only): each video's own frame count and stamps (LF used the first video's frame count
  for all and indexed the metadata by message, so a video in a later turn raised ``IndexError``).
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from llamafactory_qwenvl_patch.frame.families import LF_VIDEO_DEFAULTS
from llamafactory_qwenvl_patch.frame.video import METADATA_FPS, VideoPlan, VideoPolicy
from llamafactory_qwenvl_patch.image_io.video import probe, read_clip, rewindable
from llamafactory_qwenvl_patch.integration import lf_compat

_mm_plugin = lf_compat.require_module("llamafactory.data.mm_plugin", ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER"])


def _rewound(videos: list[Any]) -> list[Any]:
    """``videos`` with each stream that cannot rewind (a video URL LF's API opened) read into memory, in place: LF
    hands the same list to token counting and then to the pixels, and each reads every video."""
    for index, video in enumerate(videos):
        videos[index] = rewindable(video)
    return videos


@dataclass
class PinnedVideos:
    """Mixin: video frames, their count and their clock from the pinned video policy. Dataclass fields, so the policy
    is part of LF's ``datasets`` cache fingerprint."""

    qwenvl_video_min_pixels: int = 0
    qwenvl_video_max_pixels: int = 0
    qwenvl_video_fps: float = LF_VIDEO_DEFAULTS["video_fps"]
    qwenvl_video_maxlen: int = LF_VIDEO_DEFAULTS["video_maxlen"]
    qwenvl_video_clock: str = "stamps"
    qwenvl_frame_list_fps: float = LF_VIDEO_DEFAULTS["video_fps"]

    @property
    def video_policy(self) -> VideoPolicy:
        return VideoPolicy(self.qwenvl_video_min_pixels, self.qwenvl_video_max_pixels, self.qwenvl_factor,
                           self.qwenvl_video_fps, self.qwenvl_video_maxlen, self.qwenvl_video_clock)

    def _regularize_videos(self, videos: list[Any], **kwargs: Any) -> dict[str, Any]:
        policy = self.video_policy
        clips, plans = [], []
        for video in _rewound(videos):
            frames, plan = read_clip(video, policy, self.qwenvl_frame_list_fps)
            clips.append(frames)
            plans.append(plan)
        return {"videos": clips, "plans": plans, "fps_per_video": [p.rate for p in plans],
                "durations": [p.duration for p in plans], "frames_indices": [p.frames_indices for p in plans]}

    def _video_plans(self, videos: list[Any]) -> tuple[list[VideoPlan], list[tuple[int, int]]]:
        """Each video's plan and frame size from its packets or frame-list headers (nothing decoded)."""
        policy = self.video_policy
        plans, sizes = [], []
        for video in _rewound(videos):
            clip = probe(video, self.qwenvl_frame_list_fps)
            plans.append(clip.plan(policy))
            sizes.append(policy.frame_size(clip.height, clip.width))
        return plans, sizes

    def _get_video_token_metadata(self, videos: list[Any], processor: Any) -> dict[str, Any]:
        import torch

        plans, sizes = self._video_plans(videos)
        patch = self.video_policy.frame_policy.patch_size
        grid = [[plan.groups, height // patch, width // patch] for plan, (height, width) in zip(plans, sizes)]
        return {"video_grid_thw": torch.tensor(grid, dtype=torch.long).reshape(-1, 3),
                "video_metadata": [SimpleNamespace(frames_indices=plan.frames_indices, fps=METADATA_FPS,
                                                   stamp_texts=plan.stamp_texts) for plan in plans]}

    def _get_mm_inputs(self, images: list[Any], videos: list[Any], audios: list[Any], processor: Any
                       ) -> dict[str, Any]:
        mm_inputs = super()._get_mm_inputs(images, [], audios, processor)
        if not videos:
            return mm_inputs
        data = self._regularize_videos(videos)
        plans: list[VideoPlan] = data["plans"]
        kwargs: dict[str, Any] = {"videos": data["videos"], "do_resize": False, "return_tensors": "pt"}
        if self.qwenvl_video_clock == "stamps":  # the Qwen3 processors read each video's own clock from its metadata
            # (not returned: nothing after the processor reads it, and LF's HF engine turns every mm input into a
            # tensor, which a list of VideoMetadata is not)
            kwargs.update(video_metadata=[plan.metadata(len(frames)) for plan, frames in zip(plans, data["videos"])],
                          do_sample_frames=False)
        mm_inputs.update(processor.video_processor(**kwargs))
        if "second_per_grid_ts" in processor.model_input_names:
            mm_inputs["second_per_grid_ts"] = [plan.second_per_grid_ts for plan in plans]
        return mm_inputs


@dataclass
class PinnedVideoStamps(PinnedVideos):
    """Qwen3-VL / Qwen3.5: each video's ``<t seconds>`` stamps and frame count, wherever it appears."""

    def process_messages(self, messages: list[dict[str, str]], images: list[Any], videos: list[Any],
                         audios: list[Any], processor: Any) -> list[dict[str, str]]:
        if not videos or not self.expand_mm_tokens:
            return super().process_messages(messages, images, videos, audios, processor)
        self._validate_input(processor, images, videos, audios)
        self._validate_messages(messages, images, videos, audios)
        image_grid_thw = self._get_mm_token_metadata(images, [], [], processor)["image_grid_thw"] if images else []
        video_meta = self._get_video_token_metadata(videos, processor)
        image_merge = processor.image_processor.merge_size ** 2
        video_merge = processor.video_processor.merge_size ** 2
        bos, eos = self.vision_bos_token, self.vision_eos_token
        messages = deepcopy(messages)
        num_images = num_videos = 0
        for message in messages:
            content = message["content"]
            while _mm_plugin.IMAGE_PLACEHOLDER in content:
                seqlen = int(image_grid_thw[num_images].prod()) // image_merge
                content = content.replace(_mm_plugin.IMAGE_PLACEHOLDER, f"{bos}{self.image_token * seqlen}{eos}", 1)
                num_images += 1
            while _mm_plugin.VIDEO_PLACEHOLDER in content:
                grid = video_meta["video_grid_thw"][num_videos]
                stamps = video_meta["video_metadata"][num_videos].stamp_texts
                seqlen = int(grid[1:].prod()) // video_merge
                structure = "".join(f"{stamps[g]}{bos}{self.video_token * seqlen}{eos}" for g in range(int(grid[0])))
                content = content.replace(_mm_plugin.VIDEO_PLACEHOLDER, structure, 1)
                num_videos += 1
            message["content"] = content
        return messages
