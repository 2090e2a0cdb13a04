"""The training inputs of multi-turn trajectories: one row per trajectory (the task's root, then its actions and
observations), left-padded, with every screenshot in order, explicit M-RoPE positions (each row's own
``get_rope_index``: a screenshot advances positions by its grid, not by its tokens) and the index of the positions
that predict an action token, so the forward keeps logits only there (``ACTION_INDEX``, read by the trainer's
log-prob pass).

With the shared prefix (``packed_trajectory_inputs``) a task's G trajectories are one packed row instead: the
root (task prompt and first screenshot) computed once, each trajectory's suffix attending to it and to itself
(``shared_prefix``), with the suffix's positions of the one-piece row; the loss reads the same targets and mask, per
trajectory, at the suffix tokens that are actions.

What the loss sees per row is then ``(targets, mask)`` at those K positions: the action tokens (stop tokens included)
and 1 where the row's token is one of its own action tokens; observation tokens are never a target (the padding
token stands in for them, masked).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from llamafactory_qwenvl_patch.grpo.rollout import shared_prefix
from llamafactory_qwenvl_patch.grpo.rollout.turn_forward import next_position, row_positions, suffix_positions

ACTION_INDEX = "qwenvl_action_index"  # an inputs key: (K,) the positions whose logits the loss reads
PAD_POSITION = 1  # what HF's get_rope_index gives padding


Dummy = tuple[list[int], Any]  # a screenshot's tokens (vision start, its pads, vision end) and the screenshot


def _with_dummy(rows: list[tuple[list[int], list[int], list[Any]]], dummy: Dummy | None
                ) -> list[tuple[list[int], list[int], list[Any]]]:
    """``rows`` with the first empty one (a trajectory failed at reset) holding ``dummy``, masked, when no row has a
    screenshot: under ZeRO-3 every rank must run the vision tower, whose weights it gathers with the others."""
    if dummy is None or any(images for _, _, images in rows) or not any(not ids for ids, _, _ in rows):
        return rows
    first = next(k for k, (ids, _, _) in enumerate(rows) if not ids)
    ids, image = dummy
    return [*rows[:first], (list(ids), [0] * len(ids), [image]), *rows[first + 1:]]


def trajectory_inputs(model: Any, rows: Sequence[tuple[list[int], list[int], list[Any]]], image_processor: Any,
                      pad_id: int, dummy: Dummy | None = None) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(inputs, targets (B, K), mask (B, K)) of ``rows``: each (ids, loss mask, model-input screenshots in order).
    ``image_processor`` is the run's pinned one: the screenshots are already in the frame, so it keeps their size.
    ``dummy``: a masked screenshot for a batch that has none (``_with_dummy``)."""
    rows = _with_dummy(list(rows), dummy)
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


Member = tuple[list[int], list[int], list[Any]]  # a trajectory after its root: ids, loss mask, screenshots


def packed_trajectory_inputs(model: Any, groups: Sequence[tuple[list[int], list[Any], Sequence[Member]]],
                             image_processor: Any, pad_id: int, generations: int, dummy: Dummy | None = None
                             ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets (B*G, K), mask (B*G, K), suffix index (K,)) of ``groups``: each (root ids, root screenshots,
    G members). One packed row a group (``shared_prefix.pack_group``): the root left-padded, then each member's
    suffix right-padded, the screenshots in that order; every token at the position of its trajectory's one-piece
    row (the root's own, each suffix's shifted past the root: ``suffix_positions``); logits kept at the K suffix
    places (the union over the batch) whose next token is an action token. A group with no root (every reset
    failed) is one pad token and no member tokens, masked; with ``dummy``, when no group has a root, the first holds
    the dummy screenshot as its root instead (``_with_dummy``)."""
    G = generations
    groups = list(groups)
    if dummy is not None and groups and not any(root for root, _, _ in groups):
        groups[0] = (list(dummy[0]), [dummy[1]], [([], [], [])] * G)
    groups = [(root, images, members) if root else ([pad_id], [], [([], [], [])] * G) for root, images, members in groups]
    if any(len(members) != G for _, _, members in groups):
        raise RuntimeError(f"a packed group of trajectories does not hold {G} members; please report this")
    B = len(groups)
    P = max(len(root) for root, _, _ in groups)
    T = max([1] + [len(ids) for _, _, members in groups for ids, _, _ in members])
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    root_positions = torch.full((3, B, P), PAD_POSITION, dtype=torch.long)
    ids = torch.full((B * G, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B * G, T), dtype=torch.long)
    loss_mask = torch.zeros((B * G, T), dtype=torch.long)
    positions = torch.full((3, B * G, T), PAD_POSITION, dtype=torch.long)
    counts = [n for _, images, members in groups for n in (len(images), *(len(m[2]) for m in members))]
    images = [image for _, root_images, members in groups for image in (*root_images, *(i for m in members
                                                                                           for i in m[2]))]
    inputs: dict[str, Any] = {}
    grids: list[torch.Tensor | None] = [None] * len(counts)
    if images:
        visual = image_processor(images=images, return_tensors="pt")
        inputs["pixel_values"], inputs["image_grid_thw"] = visual["pixel_values"], visual["image_grid_thw"]
        grids = [grid if n else None for grid, n in zip(visual["image_grid_thw"].split(counts), counts)]
    grids_of = iter(grids)
    for b, (root, _, members) in enumerate(groups):
        start = P - len(root)
        prompt_ids[b, start:] = torch.tensor(root)
        prompt_mask[b, start:] = 1  # a rootless group's pad token too: every query of the row then sees a key
        root_positions[:, b, start:] = row_positions(model, prompt_ids[b, start:], next(grids_of))
        after = next_position(root_positions[:, b, start:])
        for g, (member_ids, member_mask, _) in enumerate(members):
            row, n, grid = b * G + g, len(member_ids), next(grids_of)
            if n:
                ids[row, :n] = torch.tensor(member_ids)
                attention[row, :n] = 1
                loss_mask[row, :n] = torch.tensor(member_mask)
                positions[:, row, :n] = suffix_positions(model, ids[row, :n], grid, after)
    inputs_packed, layout = shared_prefix.pack_group(prompt_ids, prompt_mask, ids, attention, G)
    index = loss_mask.bool().any(dim=0).nonzero().squeeze(1)
    if index.numel() == 0:  # no action token in the batch: one place, masked
        index = torch.zeros(1, dtype=torch.long)
    # suffix token j of member g is predicted by the root's last token (j = 0) or the member's token j - 1
    starts = P + T * torch.arange(G)
    layout.keep = torch.where(index == 0, P - 1, starts[:, None] + index - 1).flatten()
    layout.positions_given = True
    inputs.update(inputs_packed, position_ids=torch.cat([root_positions, positions.reshape(3, B, G * T)], dim=2))
    inputs[shared_prefix.KWARG] = layout
    mask = loss_mask[:, index]
    targets = torch.where(mask.bool(), ids[:, index], torch.full_like(mask, pad_id))
    return inputs, targets, mask, index


def suffix_values(values: Sequence[list[float]], width: int, index: torch.Tensor) -> torch.Tensor:
    """(B*G, K): per-token values of each member's suffix (aligned with its ids), at the suffix places ``index``
    that ``packed_trajectory_inputs`` kept."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for row, row_values in enumerate(values):
        out[row, :len(row_values)] = torch.tensor(row_values, dtype=torch.float32)
    return out[:, index.cpu()]
