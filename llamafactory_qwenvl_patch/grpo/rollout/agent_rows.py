"""The training inputs of multi-turn trajectories: one row per trajectory (the task's root, then its actions and
observations), left-padded, with every screenshot in order, explicit M-RoPE positions (each row's own
``get_rope_index``: a screenshot advances positions by its grid, not by its tokens) and the index of the positions
that predict an action token, so the forward keeps logits only there (``ACTION_INDEX``, read by the trainer's
log-prob pass).

What the loss sees per row is then ``(targets, mask)`` at those K positions: the action tokens (stop tokens included)
and 1 where the row's token is one of its own action tokens; observation tokens are never a target (the padding
token stands in for them, masked).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from llamafactory_qwenvl_patch.grpo.rollout.turn_forward import row_positions

ACTION_INDEX = "qwenvl_action_index"  # an inputs key: (K,) the positions whose logits the loss reads
PAD_POSITION = 1  # what HF's get_rope_index gives padding


def trajectory_inputs(model: Any, rows: Sequence[tuple[list[int], list[int], list[Any]]], image_processor: Any,
                      pad_id: int) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(inputs, targets (B, K), mask (B, K)) of ``rows``: each (ids, loss mask, model-input screenshots in order).
    ``image_processor`` is the run's pinned one: the screenshots are already in the frame, so it keeps their size."""
    rows = [(ids, mask, images) if ids else ([pad_id], [0], []) for ids, mask, images in rows]
    width = max(len(ids) for ids, _, _ in rows)
    B = len(rows)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention = torch.zeros((B, width), dtype=torch.long)
    loss_mask = torch.zeros((B, width), dtype=torch.long)
    positions = torch.full((3, B, width), PAD_POSITION, dtype=torch.long)
    images = [image for _, _, row_images in rows for image in row_images]
    inputs: dict[str, Any] = {}
    grids: list[torch.Tensor] = []
    if images:
        visual = image_processor(images=images, return_tensors="pt")
        inputs["pixel_values"], inputs["image_grid_thw"] = visual["pixel_values"], visual["image_grid_thw"]
        grids = list(visual["image_grid_thw"].split([len(row_images) for _, _, row_images in rows]))
    for b, (ids, mask, row_images) in enumerate(rows):
        start = width - len(ids)
        input_ids[b, start:] = torch.tensor(ids)
        attention[b, start:] = 1
        loss_mask[b, start:] = torch.tensor(mask)
        grid = grids[b] if row_images else None
        positions[:, b, start:] = row_positions(model, input_ids[b, start:], grid)
    inputs.update(input_ids=input_ids, attention_mask=attention, position_ids=positions)
    predicts = loss_mask[:, 1:].bool()  # position i predicts token i + 1
    index = predicts.any(dim=0).nonzero().squeeze(1)
    if index.numel() == 0:  # no action token in the batch (every trajectory failed): one position, masked
        index = torch.tensor([width - 2 if width > 1 else 0])
    inputs[ACTION_INDEX] = index
    targets = input_ids[:, (index + 1).clamp(max=width - 1)]
    mask = predicts[:, index].long() if width > 1 else torch.zeros_like(targets)
    # another row's action position may predict a screenshot pad here, whose log-prob under the sampled
    # distribution (vision tokens suppressed) is -inf: a masked -inf still makes the KL and the gradient NaN
    return inputs, torch.where(mask.bool(), targets, torch.full_like(targets, pad_id)), mask


def action_values(values: Sequence[list[float]], width: int, index: torch.Tensor) -> torch.Tensor:
    """(B, K): per-token values of each row (aligned with its ids, e.g. the sampler's log-probs), left-padded to
    ``width`` as ``trajectory_inputs`` pads the ids, at the tokens the kept positions ``index`` predict."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for b, row in enumerate(values):
        if row:
            out[b, width - len(row):] = torch.tensor(row, dtype=torch.float32)
    return out[:, (index.cpu() + 1).clamp(max=width - 1)]
