"""The token types transformers 5.x Qwen-VL models need to place M-RoPE positions.

Without ``mm_token_type_ids`` transformers 5.x gives the vision tokens plain text positions. LF's training collator
computes 3-D positions itself, but LF's inference engine and a plain ``model(**batch)`` do not pass the types, so
the model would read images with other positions than it was trained with.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def needs_token_types(model: Any) -> bool:
    """The (unwrapped, possibly PEFT-wrapped) model's forward takes ``mm_token_type_ids``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "mm_token_type_ids" in inspect.signature(type(base).forward).parameters


def token_types(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """0 for text, 1 for image tokens, 2 for video tokens (what the HF processor returns)."""
    types = torch.zeros_like(input_ids)
    types[input_ids == config.image_token_id] = 1
    video_id = getattr(config, "video_token_id", None)
    if video_id is not None:
        types[input_ids == video_id] = 2
    return types
