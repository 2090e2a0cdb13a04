"""Shared-prefix GRPO passes: each prompt and its images are computed once per group, not once per completion.

A group is packed into one row, ``[prompt (P, left-padded) | completion 1 (T) | ... | completion G (T)]``, with the
prompt's images once. In the language model's attention (an ``AttentionInterface`` function, so no modelling code is
forked) the prompt attends causally to itself, and each completion attends to the prompt's keys and values and to
its own earlier tokens only: prefix self-attention plus suffix concat-attention, as in PrefixGrouper. A pre-hook on
the language model gives every completion token the position it has in the repeated layout (the position of the
prompt's last token + 1 + its index: the same in each M-RoPE section, as ``get_rope_index`` gives text after the
prompt), so the model's own code computes the prompt's 3-D positions, images and deepstack features. Log-probs and
gradients equal those of the repeated layout up to float rounding (``tests/unit/grpo/test_grpo_shared_prefix.py``).
Linear-attention layers (Qwen3.5's Gated DeltaNet) start every completion from the prompt's end states instead
(``linear_prefix``), so hybrid models are exact too.

An agent's group packs the same way (``agent_rows.packed_trajectory_inputs``): the task's root (prompt and first
screenshot) once, then each trajectory's actions and later screenshots as its completion, with the positions of
the trajectory's one-piece row passed in (``PrefixLayout.positions_given``) and logits kept only where an action
token is predicted.

PrefixGrouper itself (PyPI ``prefix-grouper``) is not used: it needs a modified modelling file that takes its object
in ``forward`` (verl ships one for text-only Qwen3), and it leaves positions and the vision tower to the caller.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from llamafactory_qwenvl_patch.grpo.rollout import linear_prefix

KWARG = linear_prefix.KEYWORD  # the forward keyword that carries the layout down to the attention function
ATTENTION = "qwenvl_shared_prefix"  # the name registered in transformers' AttentionInterface
SETTINGS = ("auto", "true", "false")
# the implementations whose attention this one reproduces (it computes with SDPA: eager's math, other rounding)
SUPPORTED_BASES = ("sdpa", "eager")

logger = logging.getLogger("llamafactory.qwenvl_patch.grpo")


@dataclass
class PrefixLayout:
    """Where the prompt and the completions lie in a packed row, and the attention masks of both parts."""

    prompt_length: int  # P: the prompt width of the micro-batch (prompts are left-padded to it)
    generations: int  # G
    completion_length: int  # T: every completion is right-padded to it
    prefix_mask: torch.Tensor | None  # (B, 1, P, P) bool; None: no padding, plain causal attention
    suffix_mask: torch.Tensor  # (B*G, 1, T, P+T) bool: prompt keys, then the completion's own causal keys
    keep: torch.Tensor  # (G*K,) positions whose logits are kept (K = T: every completion token; fewer for agents)
    # the caller passes every token's position_ids (a trajectory's suffix holds screenshots, so its positions are
    # not the text run ``following`` numbers); the pre-hook then leaves them as they are
    positions_given: bool = False


def pack_group(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
               completion_mask: torch.Tensor, generations: int) -> tuple[dict[str, torch.Tensor], PrefixLayout]:
    """(input_ids and attention_mask of the packed rows, their layout). ``completion_*`` are (B*G, T) in
    ``repeat_interleave`` order, as sampled; the prompt tensors are (B, P)."""
    B, P = prompt_ids.shape
    G, T = generations, completion_ids.size(1)
    device = prompt_ids.device
    prompt_keys = prompt_mask.bool()
    comp_keys = completion_mask.bool()
    causal_p = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    prefix_mask = None
    if not prompt_keys.all():
        prefix_mask = causal_p & prompt_keys[:, None, :]
        # a padding query sees no key; let it see itself (any finite value will do: no real token reads it)
        prefix_mask |= torch.eye(P, dtype=torch.bool, device=device) & ~prefix_mask.any(-1, keepdim=True)
        prefix_mask = prefix_mask.unsqueeze(1)
    causal_t = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    own = causal_t & comp_keys[:, None, :]  # (B*G, T, T)
    shared = prompt_keys.repeat_interleave(G, 0)[:, None, :].expand(B * G, T, P)
    suffix_mask = torch.cat([shared, own], dim=2).unsqueeze(1)
    starts = P + T * torch.arange(G, device=device)
    keep = torch.cat([torch.full((G, 1), P - 1, device=device), starts[:, None] + torch.arange(T - 1, device=device)],
                     dim=1).flatten()
    inputs = {
        "input_ids": torch.cat([prompt_ids, completion_ids.reshape(B, G * T)], dim=1),
        "attention_mask": torch.cat([prompt_mask, completion_mask.reshape(B, G * T)], dim=1),
    }
    return inputs, PrefixLayout(P, G, T, prefix_mask, suffix_mask, keep)


def unpack_logits(logits: torch.Tensor, layout: PrefixLayout) -> torch.Tensor:
    """(B, G*K, V) logits at ``layout.keep`` -> (B*G, K, V), the rows in the order of the completions."""
    B = logits.size(0)
    return logits.reshape(B * layout.generations, -1, logits.size(-1))


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any
               ) -> tuple[torch.Tensor, None]:
    """Prefix self-attention plus suffix concat-attention over a packed row (see the module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout: PrefixLayout | None = kwargs.get(KWARG)
    if layout is None:
        raise RuntimeError("shared-prefix attention ran without its layout: a forward inside the GRPO shared-prefix "
                           "context did not pass it; please report this")
    P, G, T = layout.prompt_length, layout.generations, layout.completion_length
    B, H, _, D = query.shape
    Hkv = key.size(1)
    prefix, _ = sdpa_attention_forward(module, query[:, :, :P], key[:, :, :P], value[:, :, :P], layout.prefix_mask,
                                       dropout=dropout, scaling=scaling, is_causal=layout.prefix_mask is None)

    def per_completion(x: torch.Tensor, heads: int) -> torch.Tensor:  # (B, h, G*T, D) -> (B, G, h, T, D)
        return x[:, :, P:].reshape(B, heads, G, T, D).transpose(1, 2)

    def with_prefix(x: torch.Tensor) -> torch.Tensor:  # (B*G, Hkv, P+T, D)
        shared = x[:, :, :P].unsqueeze(1).expand(B, G, Hkv, P, D)
        return torch.cat([shared, per_completion(x, Hkv)], dim=3).reshape(B * G, Hkv, P + T, D)

    suffix, _ = sdpa_attention_forward(module, per_completion(query, H).reshape(B * G, H, T, D), with_prefix(key),
                                       with_prefix(value), layout.suffix_mask, dropout=dropout, scaling=scaling,
                                       is_causal=False)
    return torch.cat([prefix, suffix.reshape(B, G * T, H, D)], dim=1), None


def received_positions(kwargs: dict[str, Any]) -> torch.Tensor:
    """The (3 or 4, B, L) positions a language-model forward uses, from the keywords it received (without
    ``position_ids`` it numbers the tokens 0..L-1)."""
    embeds = kwargs["inputs_embeds"]
    B, L = embeds.shape[:2]
    positions = kwargs.get("position_ids")
    if positions is None:
        return torch.arange(L, device=embeds.device).view(1, 1, L).expand(3, B, L)
    return positions[None].expand(3, B, L) if positions.ndim == 2 else positions


def following(positions: torch.Tensor, prompt_length: int, count: int) -> torch.Tensor:
    """Positions of ``count`` text tokens right after the prompt: the prompt's last position + 1, + 2, ... in every
    M-RoPE section, what ``get_rope_index`` gives text after text."""
    last = positions[:, :, prompt_length - 1:prompt_length]
    return last + 1 + torch.arange(count, device=positions.device)


def _completion_positions(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    """Language-model pre-hook: every completion starts right after the prompt, as in the repeated layout (the
    model computed the prompt's positions, M-RoPE included)."""
    layout: PrefixLayout | None = kwargs.get(KWARG)
    if layout is None or layout.positions_given:
        return None
    positions = received_positions(kwargs)
    P, G, T = layout.prompt_length, layout.generations, layout.completion_length
    suffix = following(positions, P, T).repeat(1, 1, G)
    kwargs["position_ids"] = torch.cat([positions[:, :, :P], suffix], dim=2)
    return args, kwargs


def hf_model(model: Any) -> Any:
    """The transformers model inside DDP / DeepSpeed / PEFT wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def language_model(model: Any) -> torch.nn.Module:
    """The decoder whose attention is shared: ``model.language_model`` of a Qwen-VL (transformers 4.52 to 5.x)."""
    inner = getattr(hf_model(model), "model", None)
    decoder = getattr(inner, "language_model", None)
    if not isinstance(decoder, torch.nn.Module):
        raise RuntimeError(f"{type(hf_model(model)).__name__} has no model.language_model: grpo_shared_prefix "
                           "supports Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 models")
    return decoder


def unsupported_reason(model: Any) -> str | None:
    """Why the shared prefix cannot run on ``model`` (None: it can)."""
    try:
        decoder = language_model(model)
    except RuntimeError as error:
        return str(error)
    base = decoder.config._attn_implementation
    if base not in SUPPORTED_BASES:
        return (f"the language model's attention is {base!r}; the shared prefix reproduces "
                f"{' and '.join(SUPPORTED_BASES)} only (variable-length flash attention is not implemented)")
    return linear_prefix.unsupported_reason(decoder)


def resolve(setting: str, models: list[Any]) -> bool:
    """``grpo_shared_prefix`` for these models (policy and reference): auto turns it on wherever it applies and says
    why once where it does not; true where it cannot apply is an error."""
    reasons = [reason for reason in map(unsupported_reason, models) if reason]
    if setting == "false":
        return False
    if not reasons:
        logger.info("grpo_shared_prefix: on (each prompt and its images are computed once per group)")
        return True
    if setting == "true":
        raise ValueError(f"grpo_shared_prefix: true cannot apply: {reasons[0]}. Use auto or false.")
    logger.info(f"grpo_shared_prefix: off ({reasons[0]}); each prompt is repeated for every completion")
    return False


def install(model: Any) -> None:
    """Register the attention function (once per process), the position hook on ``model``'s language model and
    the packed forward of its linear-attention layers (once per model). All act only on forwards that carry a
    layout."""
    from transformers import AttentionInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, _attention)
    decoder = language_model(model)
    if not getattr(decoder, "_qwenvl_shared_prefix_hook", False):
        decoder.register_forward_pre_hook(_completion_positions, with_kwargs=True)
        decoder._qwenvl_shared_prefix_hook = True
    linear_prefix.install(decoder)


@contextmanager
def attention_active(models: list[Any]) -> Iterator[None]:
    """Within it the language models of ``models`` attend with the shared-prefix function: forwards and the
    backward (gradient checkpointing recomputes inside it) must both run here."""
    configs = {id(c): c for c in (language_model(m).config for m in models)}.values()
    saved = [(config, config._attn_implementation) for config in configs]
    for config in configs:
        config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        for config, value in saved:
            config._attn_implementation = value
