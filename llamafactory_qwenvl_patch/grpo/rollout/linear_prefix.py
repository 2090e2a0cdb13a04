"""Shared-prefix passes through linear-attention (Gated DeltaNet) layers, exact: Qwen3.5 and Qwen3.5-MoE.

A Gated DeltaNet layer carries two states along the sequence: the causal conv's window (its last K-1 inputs) and the
delta rule's recurrent state. In the packed row ``[prompt | completion 1 | ... | completion G]`` the model's own
forward would let completion 2 start from the end of completion 1. Here the prompt runs once from the zero state,
and every completion starts from the prompt's end states: the conv reads the prompt's last K-1 inputs before the
completion's own, and the delta rule starts from the prompt's final recurrent state (the chunked rule's
``initial_state``, in transformers' torch rule and in flash-linear-attention's kernel alike). That is exactly what
each row of the repeated layout computes; the prompt's gradient is the sum over its G completions, as there.

The layer's own modules (projections, conv weights, gated norm, output projection) and its own rule function are
called, so LoRA adapters, ZeRO-3 hooks and gradient checkpointing see the usual calls; only the order of the
sequence is arranged here. The decoder layer does not pass keywords to its token mixer, so a pre-hook on each
hybrid decoder layer hands the mixer the layout of the current call (recomputation under checkpointing included).
"""

from __future__ import annotations

from types import MethodType
from typing import Any, Callable

import torch
import torch.nn.functional as F

LINEAR = "linear_attention"
FULL = "full_attention"
# what the packed forward reads from a Gated DeltaNet module (transformers 5.2 to 5.6 name them so)
MIXER_NAMES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "conv_kernel_size", "key_dim",
               "value_dim", "head_k_dim", "head_v_dim", "num_k_heads", "num_v_heads", "A_log", "dt_bias", "norm",
               "out_proj", "chunk_gated_delta_rule")
LAYOUT_ATTRIBUTE = "_qwenvl_prefix_layout"
KEYWORD = "qwenvl_shared_prefix"  # the forward keyword that carries the layout (``shared_prefix.KWARG``)


def layer_types(decoder: torch.nn.Module) -> list[str]:
    """The decoder's layer kinds (all full attention for a model without ``layer_types``)."""
    types = getattr(decoder.config, "layer_types", None)
    return list(types) if types else [FULL] * len(decoder.layers)


def mixers(decoder: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(decoder layer, its Gated DeltaNet) for every linear-attention layer."""
    return [(layer, getattr(layer, "linear_attn", None)) for layer, kind in zip(decoder.layers, layer_types(decoder))
            if kind == LINEAR]


def unsupported_reason(decoder: torch.nn.Module) -> str | None:
    """Why the packed forward cannot be exact for ``decoder``'s layers (None: it can)."""
    import transformers

    other = sorted(set(layer_types(decoder)) - {LINEAR, FULL})
    if other:
        return f"its layers include {', '.join(other)}, which the shared prefix does not reproduce"
    for layer, mixer in mixers(decoder):
        missing = [name for name in MIXER_NAMES if not hasattr(mixer, name)] if mixer is not None else ["linear_attn"]
        if missing:
            return (f"transformers {transformers.__version__}: the linear-attention layer "
                    f"{type(mixer or layer).__name__} has no {', '.join(missing)}, which the exact shared prefix "
                    "reads (tested with transformers 5.6)")
    return None


def _heads(mixer: Any, mixed: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(query, key, value, g, beta) of the delta rule from the conv output ``mixed`` (N, C, L) and the layer input
    ``hidden`` (N, L, D), as the layer computes them."""
    N, _, L = mixed.shape
    query, key, value = torch.split(mixed.transpose(1, 2), [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    query = query.reshape(N, L, -1, mixer.head_k_dim)
    key = key.reshape(N, L, -1, mixer.head_k_dim)
    value = value.reshape(N, L, -1, mixer.head_v_dim)
    beta = mixer.in_proj_b(hidden).sigmoid()
    g = -mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(hidden).float() + mixer.dt_bias)
    repeat = mixer.num_v_heads // mixer.num_k_heads
    if repeat > 1:
        query = query.repeat_interleave(repeat, dim=2)
        key = key.repeat_interleave(repeat, dim=2)
    return query, key, value, g, beta


def packed_forward(mixer: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, layout: Any
                   ) -> torch.Tensor:
    """The Gated DeltaNet over packed rows (B, P + G*T, D), each completion continuing the prompt's states;
    ``layout`` is ``shared_prefix.PrefixLayout`` (prompt_length, generations, completion_length)."""
    P, G, T = layout.prompt_length, layout.generations, layout.completion_length
    B, _, D = hidden_states.shape
    if attention_mask is not None:  # padding tokens are zeroed before they enter either state, as the layer does
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    prompt = hidden_states[:, :P]
    completions = hidden_states[:, P:].reshape(B * G, T, D)
    width = mixer.conv_kernel_size - 1
    qkv_prompt = mixer.in_proj_qkv(prompt).transpose(1, 2)  # (B, C, P)
    qkv_completions = mixer.in_proj_qkv(completions).transpose(1, 2)  # (B*G, C, T)
    conv_prompt = F.silu(mixer.conv1d(qkv_prompt)[:, :, :P])
    # the conv window each completion starts with: the prompt's last K-1 inputs (zeros before a short prompt)
    window = F.pad(qkv_prompt, (max(0, width - P), 0))
    window = window[:, :, window.size(-1) - width:].repeat_interleave(G, 0)
    conv_completions = F.silu(mixer.conv1d(torch.cat([window, qkv_completions], dim=2))[:, :, width:width + T])
    rule: Callable = mixer.chunk_gated_delta_rule
    q, k, v, g, beta = _heads(mixer, conv_prompt, prompt)
    core_prompt, state = rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
    q, k, v, g, beta = _heads(mixer, conv_completions, completions)
    core_completions, _ = rule(q, k, v, g=g, beta=beta, initial_state=state.repeat_interleave(G, 0),
                               output_final_state=False, use_qk_l2norm_in_kernel=True)
    core = torch.cat([core_prompt, core_completions.reshape(B, G * T, *core_completions.shape[2:])], dim=1)
    z = mixer.in_proj_z(hidden_states)
    core = mixer.norm(core.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(core.reshape(B, P + G * T, -1))


def _hand_layout(layer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Decoder-layer pre-hook: the layout of this call (None outside shared-prefix passes) for its token mixer."""
    setattr(layer.linear_attn, LAYOUT_ATTRIBUTE, kwargs.get(KEYWORD))


def _drop_layout(layer: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    setattr(layer.linear_attn, LAYOUT_ATTRIBUTE, None)


def _forward(self: Any, hidden_states: torch.Tensor, cache_params: Any = None, attention_mask: Any = None
             ) -> torch.Tensor:
    """The mixer's forward: its own, or the packed one when its layer's call carries a layout."""
    layout = getattr(self, LAYOUT_ATTRIBUTE, None)
    if layout is None:
        return self._qwenvl_own_forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask)
    if cache_params is not None:
        raise RuntimeError("shared-prefix training passes run without a cache; please report this")
    return packed_forward(self, hidden_states, attention_mask, layout)


def install(decoder: torch.nn.Module) -> None:
    """Route every linear-attention layer of ``decoder`` through ``packed_forward`` on calls that carry a layout;
    other calls run the layer's own forward. Once per model; bound methods and hooks without closures, so a deep
    copy of the model routes its own layers."""
    for layer, mixer in mixers(decoder):
        if getattr(mixer, "_qwenvl_packed", False):
            continue
        layer.register_forward_pre_hook(_hand_layout, with_kwargs=True)
        layer.register_forward_hook(_drop_layout, with_kwargs=True)
        mixer._qwenvl_own_forward = mixer.forward
        mixer.forward = MethodType(_forward, mixer)
        mixer._qwenvl_packed = True
