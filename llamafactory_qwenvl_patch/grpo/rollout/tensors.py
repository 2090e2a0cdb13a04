"""The pure tensor and text helpers that turn sampled ids into a rollout's rows: completion masks and cuts, the
text kept for rewards, images and videos per prompt, the visual inputs repeated per completion."""

from __future__ import annotations

import re
from typing import Any

import torch

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy

_IMAGE_PAD_RUN = re.compile(r"(?:<\|image_pad\|>)+")


def completion_mask(completion_ids: torch.Tensor, stop_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask up to and including the first stop token, whether each row has one)."""
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device))
    length = completion_ids.size(1)
    stopped = is_stop.any(dim=1)
    first_stop = torch.where(stopped, is_stop.int().argmax(dim=1), torch.full_like(stopped, length, dtype=torch.long))
    positions = torch.arange(length, device=completion_ids.device).unsqueeze(0)
    return (positions <= first_stop.unsqueeze(1)).long(), stopped


def cut_at_tokens(completion_ids: torch.Tensor, mask: torch.Tensor, banned: list[int], pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """End each completion before its first banned token (a vision placeholder) and replace the rest with padding,
    so the training forward sees exactly the prompt's image tokens. Returns (ids, mask, which rows were cut)."""
    none = torch.zeros(completion_ids.size(0), dtype=torch.bool, device=completion_ids.device)
    if not banned:
        return completion_ids, mask, none
    hit = torch.isin(completion_ids, torch.tensor(banned, device=completion_ids.device)) & mask.bool()
    rows = hit.any(dim=1)
    if not rows.any():
        return completion_ids, mask, none
    positions = torch.arange(completion_ids.size(1), device=completion_ids.device).unsqueeze(0)
    first = torch.where(rows, hit.int().argmax(dim=1), torch.full_like(rows, completion_ids.size(1), dtype=torch.long))
    keep = positions < first.unsqueeze(1)
    return torch.where(keep, completion_ids, pad_id), mask * keep.long(), rows


def decode_kept(tokenizer: Any, ids: list[int], drop: set[int]) -> str:
    """Text of ``ids`` without padding and stop tokens but with every other special token: Qwen2-VL answers are
    ``<|box_start|>(x1,y1),(x2,y2)<|box_end|>`` and rewards, metrics and logs must see them."""
    return tokenizer.decode([t for t in ids if t not in drop], skip_special_tokens=False)


def prompt_text(tokenizer: Any, ids: list[int], drop: set[int]) -> str:
    """The prompt as the model read it, each image's run of ``<|image_pad|>`` shown once."""
    return _IMAGE_PAD_RUN.sub("<|image_pad|>", decode_kept(tokenizer, ids, drop))


def images_per_sample(input_ids: torch.Tensor, vision_start_id: int, image_id: int) -> list[int]:
    starts = input_ids[:, :-1] == vision_start_id
    return (starts & (input_ids[:, 1:] == image_id)).sum(dim=1).tolist()


def videos_per_sample(input_ids: torch.Tensor, video_id: int, grid: torch.Tensor, merge_length: int) -> list[int]:
    """How many videos each prompt holds, from its ``<|video_pad|>`` count and ``video_grid_thw`` (rows in prompt
    order; ``merge_length``: patches per placeholder token, the spatial merge size squared). Counting vision-start
    blocks would not do: Qwen3 gives every frame group of a video its own block."""
    tokens = (input_ids == video_id).sum(dim=1).tolist()
    per_video = (grid.prod(dim=1) // merge_length).tolist()
    counts, row = [], 0
    for left in tokens:
        count = 0
        while left > 0 and row < len(per_video):
            left, row, count = left - per_video[row], row + 1, count + 1
        if left != 0:
            raise RuntimeError(f"video tokens and video_grid_thw disagree ({tokens} tokens, grids {grid.tolist()})")
        counts.append(count)
    return counts


def repeat_visual(pixel_values: torch.Tensor, grid: torch.Tensor, per_sample: list[int], times: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat each sample's image patches ``times`` times, in sample order (matches ``repeat_interleave``)."""
    patches = grid.prod(dim=1).tolist()
    pixel_chunks, grid_chunks, p, g = [], [], 0, 0
    for count in per_sample:
        n_patches = int(sum(patches[g:g + count]))
        for _ in range(times):
            pixel_chunks.append(pixel_values[p:p + n_patches])
            grid_chunks.append(grid[g:g + count])
        p, g = p + n_patches, g + count
    return torch.cat(pixel_chunks), torch.cat(grid_chunks)


def repeat_values(values: Any, per_sample: list[int], times: int) -> list[Any]:
    """Repeat each sample's per-video values (``second_per_grid_ts``) ``times`` times, as ``repeat_visual`` does."""
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    out, first = [], 0
    for count in per_sample:
        out += values[first:first + count] * times
        first += count
    return out


def first_image_sizes(grid: torch.Tensor, per_sample: list[int], frame: ResizePolicy
                      ) -> list[tuple[int, int] | None]:
    """(height, width) in pixels of each sample's first image as the model saw it, from ``image_grid_thw``."""
    sizes: list[tuple[int, int] | None] = []
    rows, first = grid.tolist(), 0
    for count in per_sample:
        sizes.append(frame.size_from_grid(rows[first]) if count else None)
        first += count
    return sizes


def stack_rows(rows: list[torch.Tensor], pad: float) -> torch.Tensor:
    """(1, T_i) rows of different widths as one (N, max T) tensor, padded on the right."""
    width = max(row.size(1) for row in rows)
    return torch.cat([torch.nn.functional.pad(row, (0, width - row.size(1)), value=pad) for row in rows])
