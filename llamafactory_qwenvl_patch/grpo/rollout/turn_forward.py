"""A trajectory row's M-RoPE positions and its training forward: log-probs only where an action token is predicted.

Positions are not token indices (a screenshot advances M-RoPE by its grid's longer side, not by its tokens), so a
forward that does not start at turn 1 with the model computing positions itself gets them passed: each row's are
``get_rope_index`` of its one-piece row, asked of the model (Qwen2-VL and Qwen2.5-VL loaded as the plugin loads them,
``frame.mrope.pin_pretrained_positions``). They compose: a row ``root | suffix`` has the root's positions, then the
suffix's alone shifted by the root's largest + 1, so the root's are computed once per task (``suffix_positions``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from llamafactory_qwenvl_patch.frame.mrope import token_types
from llamafactory_qwenvl_patch.grpo.algorithm.token_stats import row_logps_and_entropy
from llamafactory_qwenvl_patch.grpo.rollout.shared_prefix import hf_model


def row_positions(model: Any, ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """(3, L) positions of one row ``ids`` (L,) holding the images of ``image_grid_thw`` in order: the model's own
    ``get_rope_index``, given the token types the HF processor would give (transformers 5.x asks for them; 4.x
    finds the vision tokens itself)."""
    inner = hf_model(model).model  # owns get_rope_index
    row = ids.unsqueeze(0)
    types = {"mm_token_type_ids": token_types(row, inner.config)} \
        if "mm_token_type_ids" in inspect.signature(inner.get_rope_index).parameters else {}
    positions, _ = inner.get_rope_index(row, image_grid_thw=image_grid_thw, attention_mask=torch.ones_like(row),
                                        **types)
    return positions[:, 0]


def next_position(positions: torch.Tensor) -> int:
    """Where text after a row with ``positions`` (3, L) starts: its largest position + 1."""
    return int(positions.max()) + 1


def suffix_positions(model: Any, ids: torch.Tensor, image_grid_thw: torch.Tensor | None, start: int
                     ) -> torch.Tensor:
    """(3, S) positions of a suffix ``ids`` (S,) after a root whose ``next_position`` is ``start``: its positions
    alone, shifted. Equal to the suffix's part of ``row_positions`` of the whole row (tested), since every text run
    and every image starts at the largest position before it + 1."""
    return row_positions(model, ids, image_grid_thw) + start


@dataclass
class ActionLogps:
    """What one forward gives the loss: per-token values at the kept indices ``index`` (K,), the union over the
    batch's rows of the positions that predict an action token; ``mask`` (B, K) says which are each row's."""

    logps: torch.Tensor  # (B, K)
    entropy: torch.Tensor | None  # (B, K), with entropy=True
    mask: torch.Tensor  # (B, K): 1 where the row's next token is an action token
    index: torch.Tensor  # (K,): the positions whose logits were kept (each predicts the token at index + 1)


def action_logps(model: Any, inputs: dict[str, Any], loss_mask: torch.Tensor, banned: torch.Tensor,
                 temperature: float, entropy: bool = False, entropy_grad: bool = False) -> ActionLogps:
    """One forward over rows ``inputs["input_ids"]`` (B, L) with their images and explicit ``position_ids``
    (3, B, L), keeping logits only where an action token (``loss_mask`` 1) is predicted (``logits_to_keep``: all
    positions of eight ten-turn rows would be tens of GB of logits), and each row's log-probs (and entropies) of the
    sampled distribution (``row_logps_and_entropy``)."""
    if "position_ids" not in inputs:
        raise ValueError("a trajectory row's forward needs its position_ids: without them the model numbers "
                         "positions from rope_deltas or token indices, which are wrong after a screenshot")
    if bool(loss_mask[:, 0].any()):
        raise ValueError("a row's first token is an action token: nothing predicts it")
    ids = inputs["input_ids"]
    predicts = loss_mask[:, 1:].bool()  # position i predicts token i + 1
    index = predicts.any(dim=0).nonzero().squeeze(1)
    logits = model(**inputs, logits_to_keep=index, use_cache=False).logits  # (B, K, V)
    targets = ids[:, index + 1]
    rows = [row_logps_and_entropy(logits[b], targets[b], banned, temperature, entropy, entropy_grad)
            for b in range(ids.size(0))]
    return ActionLogps(torch.stack([logp for logp, _ in rows]),
                       torch.stack([ent for _, ent in rows]) if entropy else None,
                       predicts[:, index].long(), index)
