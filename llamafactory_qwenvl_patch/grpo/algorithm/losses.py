"""The policy loss as pure tensor functions, and the step normalisers (the advantages are in ``advantages``).

As verl keeps ``POLICY_LOSS_REGISTRY`` apart from ``agg_loss``, a loss is a surrogate (what each token's loss is,
from its importance ratio and advantage) times an aggregation (how the tokens' losses are summed into the
micro-batch's loss). ``grpo_loss_type`` names one pair: ``LOSS_TYPES``. A new loss is a registered surrogate or
aggregation and one ``register_loss`` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

IMPORTANCE_LEVELS = ("token", "sequence")


def micro_batch_counts(masks: list[torch.Tensor]) -> torch.Tensor:
    """(micro-batches, 2): completion tokens and sequences entering the loss in each micro-batch's loss mask."""
    return torch.tensor([[float(m.sum()), float((m.sum(dim=1) > 0).sum())] for m in masks])


def step_normalizers(counts: torch.Tensor, grad_accum: int, world_size: int) -> torch.Tensor:
    """Per micro-batch (tokens, sequences) normalisers that make a token or sequence mean over the optimiser step.

    ``counts`` is ``micro_batch_counts`` of one rollout, summed over all ranks; consecutive runs of ``grad_accum`` micro-batches form one optimiser step.
    transformers' Trainer divides each micro-batch loss by ``grad_accum`` and DDP / DeepSpeed average gradients over
    ranks, so a micro-batch that divides its sum by ``step total / (world_size * grad_accum)`` contributes exactly its
    share of the step's mean, whatever the sizes of the other micro-batches.
    """
    if counts.size(0) % grad_accum:
        raise ValueError(f"{counts.size(0)} micro-batches do not split into steps of {grad_accum}")
    per_step = counts.view(-1, grad_accum, 2).sum(dim=1).clamp(min=1.0)
    return (per_step / (world_size * grad_accum)).repeat_interleave(grad_accum, dim=0)


@dataclass
class LossParts:
    loss: torch.Tensor
    kl: float
    clip_ratio: float
    entropy: float | None = None  # mean per-token entropy of the completions, when given


@dataclass(frozen=True)
class LossConfig:
    """The run's loss keys. ``cispo_cap``: CISPO's upper bound of the importance weight (trl's ``epsilon_high``
    under ``cispo``); ``delta``: the ratio's upper bound for negative advantages (two-sided clipping), None = off;
    ``entropy_coef``: the entropy bonus, 0 = off."""

    beta: float = 0.04
    eps_low: float = 0.2
    eps_high: float = 0.2
    loss_type: str = "grpo"
    max_completion_length: int = 1
    importance: str = "token"
    cispo_cap: float = 5.0
    delta: float | None = None
    entropy_coef: float = 0.0


Surrogate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "LossConfig"], tuple[torch.Tensor, torch.Tensor]]
Aggregation = Callable[[torch.Tensor, torch.Tensor, "LossConfig", float | None, float | None], torch.Tensor]
SURROGATES: dict[str, Surrogate] = {}
TAKES_DELTA: set[str] = set()  # the surrogates whose ratio ``grpo_delta`` caps
AGGREGATIONS: dict[str, Aggregation] = {}
LOSS_TYPES: dict[str, tuple[str, str]] = {}  # grpo_loss_type -> (surrogate, aggregation)


def register_surrogate(name: str, takes_delta: bool = False) -> Callable[[Surrogate], Surrogate]:
    """Decorator: ``fn(ratio, advantages, logps, config) -> (per-token loss, clipped tokens)``; ``takes_delta``: it
    reads ``config.delta`` (``grpo_delta`` is refused at parse time for the others)."""
    def add(fn: Surrogate) -> Surrogate:
        if name in SURROGATES:
            raise ValueError(f"surrogate {name!r} is registered already")
        SURROGATES[name] = fn
        if takes_delta:
            TAKES_DELTA.add(name)
        return fn
    return add


def register_aggregation(name: str) -> Callable[[Aggregation], Aggregation]:
    """Decorator: ``fn(per_token, mask, config, token_normalizer, seq_normalizer) -> loss`` (``mask`` as the loss's
    dtype; a None normaliser means this micro-batch's own count)."""
    def add(fn: Aggregation) -> Aggregation:
        if name in AGGREGATIONS:
            raise ValueError(f"aggregation {name!r} is registered already")
        AGGREGATIONS[name] = fn
        return fn
    return add


def register_loss(loss_type: str, surrogate: str, aggregation: str) -> None:
    """``grpo_loss_type: loss_type`` is ``surrogate`` aggregated by ``aggregation``."""
    if loss_type in LOSS_TYPES:
        raise ValueError(f"loss type {loss_type!r} is registered already")
    for kind, name, table in (("surrogate", surrogate, SURROGATES), ("aggregation", aggregation, AGGREGATIONS)):
        if name not in table:
            raise ValueError(f"loss {loss_type!r}: no {kind} {name!r} (registered: {', '.join(table)})")
    LOSS_TYPES[loss_type] = (surrogate, aggregation)


@register_surrogate("clipped", takes_delta=True)
def _clipped(ratio: torch.Tensor, a: torch.Tensor, logps: torch.Tensor, config: LossConfig
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, with ``delta`` capping the unclipped ratio (INTELLECT-2; trl applies it after the
    clipped copy is made, so it only binds where A < 0)."""
    clipped = torch.clamp(ratio, 1 - config.eps_low, 1 + config.eps_high)
    unclipped = ratio if config.delta is None else torch.clamp(ratio, max=config.delta)
    per_token = -torch.min(unclipped * a, clipped * a).expand_as(logps)
    is_clipped = ((ratio < 1 - config.eps_low) & (a < 0)) | ((ratio > 1 + config.eps_high) & (a > 0))
    return per_token, is_clipped.expand_as(logps)


@register_surrogate("cispo")
def _cispo(ratio: torch.Tensor, a: torch.Tensor, logps: torch.Tensor, config: LossConfig
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """-sg(min(ratio, cap)) x A x log p (MiniMax-M1; trl's form, whose bound is the ratio itself)."""
    capped = torch.clamp(ratio, max=config.cispo_cap)
    return -capped.detach() * a * logps, ((ratio > config.cispo_cap) & (a > 0)).expand_as(logps)  # trl's


@register_aggregation("sequence_mean")
def _sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, config: LossConfig, token_normalizer: float | None,
                   seq_normalizer: float | None) -> torch.Tensor:
    """Each sequence's token mean, summed over sequences, over ``seq_normalizer`` (default: the sequences of this
    batch that enter the loss)."""
    seq_tokens = mask.sum(dim=1)
    kept = float((seq_tokens > 0).sum().clamp(min=1))
    return ((per_token * mask).sum(dim=1) / seq_tokens.clamp(min=1.0)).sum() / (seq_normalizer or kept)


@register_aggregation("batch_token_mean")
def _batch_token_mean(per_token: torch.Tensor, mask: torch.Tensor, config: LossConfig,
                      token_normalizer: float | None, seq_normalizer: float | None) -> torch.Tensor:
    """The token mean over this micro-batch."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


@register_aggregation("step_token_mean")
def _step_token_mean(per_token: torch.Tensor, mask: torch.Tensor, config: LossConfig,
                     token_normalizer: float | None, seq_normalizer: float | None) -> torch.Tensor:
    """The token sum over ``token_normalizer`` (default: this micro-batch's tokens): a token mean over the step."""
    return (per_token * mask).sum() / (token_normalizer or mask.sum().clamp(min=1.0))


@register_aggregation("constant_length")
def _constant_length(per_token: torch.Tensor, mask: torch.Tensor, config: LossConfig,
                     token_normalizer: float | None, seq_normalizer: float | None) -> torch.Tensor:
    """Dr. GRPO: the token sum over N x max_completion_length."""
    return (per_token * mask).sum() / (per_token.size(0) * config.max_completion_length)


register_loss("grpo", "clipped", "sequence_mean")
register_loss("bnpo", "clipped", "batch_token_mean")
register_loss("dapo", "clipped", "step_token_mean")
register_loss("dr_grpo", "clipped", "constant_length")
register_loss("cispo", "cispo", "step_token_mean")


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    token_normalizer: float | None = None,
    seq_normalizer: float | None = None,
    sampling_weights: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
) -> LossParts:
    """The policy objective with an optional k3 KL term and entropy bonus, aggregated per ``config.loss_type``.

    Shapes: (N, T) for log-probs, ``mask`` (1 for completion tokens that enter the loss) and ``entropies``, (N,) for
    ``adv``, or (N, T) with one per token (an agent's step credit, GiGPO). ``config.importance``: ``token`` ratios
    (GRPO) or one ratio per sequence from its mean log-ratio (GSPO).
    ``grpo``: mean over each sequence's tokens, summed over sequences and divided by ``seq_normalizer`` (default:
    the sequences of this batch that enter the loss); ``bnpo``: token mean over this batch; ``dapo`` and ``cispo``:
    token sum over ``token_normalizer`` (default: this batch's tokens); ``dr_grpo``: token sum over N x
    max_completion_length. ``step_normalizers`` gives the normalisers that make ``grpo``, ``dapo`` and ``cispo``
    means over a whole optimiser step.
    ``sampling_weights`` (N, T) or (N, 1): importance weights for a sampler that is not the training model (vLLM,
    ``sampler_correction``), applied to the policy term before the KL term is added, as trl does.
    The entropy bonus subtracts ``entropy_coef`` x the token mean of ``entropies`` over ``token_normalizer`` (trl's
    bonus is a mean over each micro-batch; over the step it is exact whatever the micro-batch sizes).
    """
    if config.loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo_loss_type must be one of {', '.join(LOSS_TYPES)}, got {config.loss_type!r}")
    if config.importance not in IMPORTANCE_LEVELS:
        raise ValueError(f"grpo_importance_sampling must be one of {', '.join(IMPORTANCE_LEVELS)}, "
                         f"got {config.importance!r}")
    mask = mask.to(logps.dtype)
    seq_tokens = mask.sum(dim=1)
    log_ratio = logps - old_logps
    if config.importance == "sequence":
        log_ratio = ((log_ratio * mask).sum(dim=1) / seq_tokens.clamp(min=1.0)).unsqueeze(1)
    surrogate, aggregation = LOSS_TYPES[config.loss_type]
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv  # one per sequence, or per token (an agent's step credit)
    per_token, is_clipped = SURROGATES[surrogate](torch.exp(log_ratio), a, logps, config)
    if sampling_weights is not None:
        per_token = per_token * sampling_weights
    kl = torch.zeros_like(logps)
    if ref_logps is not None and config.beta != 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + config.beta * kl
    tokens = mask.sum().clamp(min=1.0)
    loss = AGGREGATIONS[aggregation](per_token, mask, config, token_normalizer, seq_normalizer)
    entropy = None
    if entropies is not None:
        entropy = float((entropies.detach() * mask).sum() / tokens)
        if config.entropy_coef != 0:
            loss = loss - config.entropy_coef * (entropies * mask).sum() / (token_normalizer or tokens)
    return LossParts(
        loss=loss,
        kl=float((kl.detach() * mask).sum() / tokens),
        clip_ratio=float((is_clipped.to(mask.dtype) * mask).sum() / tokens),
        entropy=entropy,
    )
