"""Batches for stage: grpo: LF's features stay raw until a rollout needs them, then LF's multimodal collator runs and
each prompt's reference answer, original image (or first video's) size, dataset index and ``meta`` are kept for the
rewards."""

from __future__ import annotations

from typing import Any

from llamafactory_qwenvl_patch.grpo.rollout.meta import META_COLUMN, TASK_COLUMN, decode_meta
from llamafactory_qwenvl_patch.grpo.rollout.tensors import decode_kept, prompt_text
from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta
from llamafactory_qwenvl_patch.image_io.images import blank_like, open_image
from llamafactory_qwenvl_patch.image_io.video import probe

FRAME_LIST_FPS_UNUSED = 1.0  # probing for a clip's size only: a frame list's rate does not change it


class GRPOCollator:
    """Batches stay raw features until a rollout needs them, so a generation batch that is reused for several
    micro-steps is loaded and processed once. ``collate`` runs LF's multimodal collator and keeps the reference
    answer, the original image size and the dataset index of each prompt."""

    def __init__(self, collator: Any, tokenizer: Any) -> None:
        self.collator = collator
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return {"grpo_features": list(features)}

    def collate(self, features: list[dict[str, Any]], drop: set[int]) -> tuple[dict[str, Any], list[SampleMeta]]:
        meta, stripped = [], []
        for feature in features:
            feature = dict(feature)
            index = int(feature.pop("grpo_index"))
            blank = bool(feature.pop("grpo_blank", False))
            record_meta = decode_meta(feature.pop(META_COLUMN, None))
            feature.pop(TASK_COLUMN, None)
            labels = [t for t in feature.get("labels") or [] if t >= 0]
            images, videos = feature.get("images") or [], feature.get("videos") or []
            orig_hw = None
            if images:
                with open_image(images[0]) as image:
                    orig_hw = (image.height, image.width)
            elif videos:  # a video prompt's boxes are in its frames: the clip's size (from its header packets)
                clip = probe(videos[0], FRAME_LIST_FPS_UNUSED)
                orig_hw = (clip.height, clip.width)
            prompt = prompt_text(self.tokenizer, feature["input_ids"], {self.tokenizer.pad_token_id})
            meta.append(SampleMeta(index, prompt, decode_kept(self.tokenizer, labels, drop).strip(), orig_hw,
                                   blank=blank, meta=record_meta))
            stripped.append(feature)
        return self.collator(stripped), meta


def blankable(feature: dict[str, Any]) -> bool:
    """Whether a prompt gets the blank-image control: it has images and no videos. A video beside blanked images
    would still show the scene, so the copy would measure nothing; blanking a clip (same length, size and clock) is
    not built."""
    return bool(feature.get("images")) and not feature.get("videos")


def blank_copy(feature: dict[str, Any]) -> dict[str, Any]:
    """The same prompt with every image blanked (same size, same image tokens), marked for the blank control."""
    return dict(feature, images=[blank_like(image) for image in feature["images"]], grpo_blank=True)
