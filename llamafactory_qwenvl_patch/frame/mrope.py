"""M-RoPE positions where the model was pretrained to see them.

The token types transformers 5.x Qwen-VL models need: without ``mm_token_type_ids`` transformers 5.x gives the vision
tokens plain text positions. LF's training collator computes 3-D positions itself, but LF's inference engine and a
plain ``model(**batch)`` do not pass the types, so the model would read images with other positions than it was
trained with.

The rule for text after a video (Qwen2-VL, Qwen2.5-VL): transformers 5.3 and later moved it inside the video's
temporal range; ``pin_pretrained_positions`` gives those models back the rule they were pretrained with.
"""

from __future__ import annotations

import inspect
import itertools
from types import MethodType
from typing import Any

import torch

from llamafactory_qwenvl_patch.frame.families import FAMILIES


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


# --- positions as Qwen2-VL and Qwen2.5-VL were pretrained ---------------------------------------------------------



def pretrained_rope_index(input_ids: torch.Tensor, token_types: torch.Tensor, image_grid_thw: Any, video_grid_thw: Any,
                          second_per_grid_ts: Any, attention_mask: torch.Tensor | None, spatial_merge_size: int,
                          tokens_per_second: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (3, B, L), deltas (B, 1)) by the rule Qwen2-VL and Qwen2.5-VL were pretrained with: Qwen's own
    ``get_rope_index``, transformers 4.x to 5.2 and vLLM's ``get_mrope_input_positions``.

    Text after a vision block starts at the block's largest position + 1; a video's frame group g sits at
    ``int(g x second_per_grid_ts x tokens_per_second)`` (Qwen2-VL, which has no clock: g). transformers 5.3 and later
    start the text at the block's start + max(h, w) / merge instead, inside a video's temporal range. Padding
    (``attention_mask`` 0) gets position 0, as transformers 5.x gives it; ``deltas`` continue generation from the
    prompt's largest position + 1.
    """
    batch, length = input_ids.shape
    positions = torch.zeros(3, batch, length, dtype=input_ids.dtype, device=input_ids.device)
    grids = {1: iter(_rows(image_grid_thw)), 2: iter(_rows(video_grid_thw))}
    seconds = iter(_rows(second_per_grid_ts))
    deltas = []
    for row in range(batch):
        keep = attention_mask[row].bool() if attention_mask is not None else torch.ones(length, dtype=torch.bool)
        kinds = token_types[row][keep.to(token_types.device)].tolist()
        blocks, start = [], 0
        for kind, run in itertools.groupby(kinds):
            count = len(list(run))
            if kind == 0:
                block = torch.arange(count).expand(3, count) + start
            else:
                t, h, w = (int(v) for v in next(grids[kind]))
                scale = float(next(seconds, 1.0)) * tokens_per_second if kind == 2 and tokens_per_second else 1.0
                block = _grid_positions(t, h // spatial_merge_size, w // spatial_merge_size, scale) + start
                if block.size(1) != count:
                    raise ValueError(f"{count} vision tokens in row {row} but their grid {[t, h, w]} holds "
                                     f"{block.size(1)}")
            blocks.append(block)
            start = int(block.max()) + 1
        positions[:, row, keep.to(positions.device)] = torch.cat(blocks, dim=1).to(positions)
        deltas.append(start - len(kinds))
    return positions, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


def _rows(values: Any) -> list:
    if values is None:
        return []
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _grid_positions(t: int, h: int, w: int, scale: float) -> torch.Tensor:
    """(3, t x h x w): each merged patch's (time, row, column); time ``int(g x scale)`` as Qwen's code and vLLM
    truncate it (float64, so a whole ``scale`` is exact)."""
    time = (torch.arange(t, dtype=torch.float64) * scale).long() if scale != 1.0 else torch.arange(t)
    return torch.stack([time.repeat_interleave(h * w), torch.arange(h).repeat_interleave(w).repeat(t),
                        torch.arange(w).repeat(h * t)])


def pin_pretrained_positions(model: Any) -> int:
    """Give every Qwen2-VL / Qwen2.5-VL inner model of ``model`` (PEFT-wrapped or not) ``pretrained_rope_index`` as
    its ``get_rope_index``, on the transformers releases that place text after a video elsewhere (5.3 on; 4.x and
    5.0-5.2 already follow the rule). Every path that asks the model for positions gets it: the training forward,
    LF's collator, ``generate`` and its ``rope_deltas``. Returns how many were pinned."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).release < (5, 3):
        return 0
    models, pinned = {f.rope_model for f in FAMILIES.values() if f.rope_model}, 0  # the inner models whose rule we pin
    for module in model.modules():
        if type(module).__name__ not in models:
            continue
        own = getattr(type(module), "get_rope_index", None)
        if own is None or not {"input_ids", "attention_mask"} <= set(inspect.signature(own).parameters):
            raise RuntimeError(f"transformers {transformers.__version__}: {type(module).__name__}.get_rope_index is "
                               "gone or takes other arguments; the plugin replaces it to keep the pretrained M-RoPE "
                               "positions. Install the tested set (pip install -c constraints.txt)")
        module.get_rope_index = MethodType(_get_rope_index, module)
        pinned += 1
    return pinned


def _get_rope_index(self: Any, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor | None = None,
                    image_grid_thw: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                    second_per_grid_ts: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                    **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``get_rope_index`` signature, answered by ``pretrained_rope_index``."""
    vision = self.config.vision_config
    kinds = mm_token_type_ids if mm_token_type_ids is not None else token_types(input_ids, self.config)
    return pretrained_rope_index(input_ids, kinds, image_grid_thw, video_grid_thw, second_per_grid_ts,
                                 attention_mask, vision.spatial_merge_size, getattr(vision, "tokens_per_second", None))
