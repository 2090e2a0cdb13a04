"""Per-token log-probs and entropies of the sampled distribution: softmax(logits / T) with the vision
placeholders suppressed (they are never sampled, so they are not part of it)."""

from __future__ import annotations

import torch


def row_logps_and_entropy(logits: torch.Tensor, ids: torch.Tensor, banned: torch.Tensor, temperature: float,
                          entropy: bool = False, entropy_grad: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(T,) log-probs of ``ids`` under one completion's (T, V) ``logits`` and, with ``entropy``, the (T,) entropy in
    nats of each position's distribution (trl's ``entropy_from_logits`` of the same distribution), differentiable
    only with ``entropy_grad`` (an entropy bonus; a logged entropy keeps no graph). In float32, one row at a time: a
    full-vocabulary softmax of every completion at once costs G x T x V floats."""
    logits = logits.float() / temperature
    if len(banned):
        logits = logits.index_fill(1, banned, float("-inf"))
    norm = torch.logsumexp(logits, dim=-1)
    chosen = torch.gather(logits, 1, ids.unsqueeze(-1)).squeeze(-1) - norm
    if not entropy:
        return chosen, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        logp = logits - norm.unsqueeze(-1)
        if not entropy_grad:
            logp = logp.detach()
        probs = torch.exp(logp)
        return chosen, -(probs * logp.masked_fill(probs == 0, 0.0)).sum(dim=-1)
