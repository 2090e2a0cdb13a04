"""HF rollouts that prefill each prompt once: G completions decoded from one prompt's key/value cache.

``generate(num_return_sequences=G)`` repeats ``input_ids`` and ``pixel_values`` G times before the prefill, so the
vision tower and the whole prompt run G times. Here the prompt (images included) is prefilled once, its cache (key
and value layers, and the conv and recurrent states of linear-attention layers) is repeated G times, and the
completions are decoded with the logits processors ``generate`` itself builds for the same ``GenerationConfig`` and
the same operations as its sample loop (float32 scores, softmax, one multinomial draw per row per step, padding after
a stop token), so the sampling distribution is ``generate``'s. Decoding positions are the
prompt's last position + 1 + step, which is what the training forward gives completion tokens (for image prompts
``generate`` gives the same; for left-padded text-only prompts transformers 5.x's ``generate`` numbers positions
without the padding while its training forward counts it: this loop follows the training forward, so it samples
exactly the distribution that is optimised).

It reproduces what stage: grpo's ``GenerationConfig`` holds (temperature, top-p, top-k, repetition penalty,
suppressed tokens, stop tokens, max_new_tokens); options that ``generate`` resolves before building its processors
(minimum lengths, length penalties) are refused. Under ZeRO-3 the caller gathers the weights first, so ranks need not
step together as ``generate``'s synced loop does.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from transformers import GenerationConfig, LogitsProcessorList

from llamafactory_qwenvl_patch.grpo.rollout.shared_prefix import following, language_model, received_positions

# GenerationConfig options generate resolves before building its processors (with its special-token tensors)
UNSUPPORTED = ("min_length", "min_new_tokens", "forced_eos_token_id", "exponential_decay_length_penalty")


@contextmanager
def _prompt_positions(model: Any) -> Iterator[list[torch.Tensor]]:
    """Collect the positions the language model uses in a forward (the model computes M-RoPE's itself)."""
    seen: list[torch.Tensor] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        seen.append(received_positions(kwargs))

    handle = language_model(model).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _logits_processors(model: Any, config: GenerationConfig, prompt_ids: torch.Tensor) -> LogitsProcessorList:
    """The processors ``generate`` applies for ``config`` (repetition penalty, suppressed tokens, temperature,
    top-k, top-p, ...), from transformers itself so that no option is missed."""
    build = getattr(model, "_get_logits_processor", None)
    if build is None:
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__}: GenerationMixin._get_logits_processor is gone; "
                           "set grpo_shared_prefix: false and report this")
    return build(generation_config=config, input_ids_seq_length=prompt_ids.size(1), encoder_input_ids=prompt_ids,
                 prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=prompt_ids.device,
                 model_kwargs={})


def sample_shared_prefix(model: Any, batch: dict[str, torch.Tensor], config: GenerationConfig) -> torch.Tensor:
    """Completion ids (B x G rows in ``repeat_interleave`` order, right-padded) for the prompts of ``batch``;
    ``config.num_return_sequences`` is G. ``model`` is the unwrapped model in eval mode, under ``no_grad``."""
    unsupported = [key for key in UNSUPPORTED if getattr(config, key, None)]
    if unsupported:
        raise ValueError(f"the shared-prefix sampler does not reproduce {', '.join(unsupported)}; "
                         "set grpo_shared_prefix: false")
    G = config.num_return_sequences or 1
    prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
    B, P = prompt_ids.shape
    pad = config.pad_token_id
    stops = torch.tensor(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id],
                         device=prompt_ids.device)
    processors = _logits_processors(model, config, prompt_ids)
    with _prompt_positions(model) as seen:
        out = model(**batch, use_cache=True, logits_to_keep=1)
    next_position = following(seen[0], P, 1).repeat_interleave(G, dim=1)  # (3 or 4, B*G, 1)
    cache = out.past_key_values
    # reorder_cache copies every layer kind G times: key/value layers and linear-attention (conv and recurrent)
    # states alike, where batch_repeat_interleave exists only for key/value layers
    cache.reorder_cache(torch.arange(B, device=prompt_ids.device).repeat_interleave(G))
    ids = prompt_ids.repeat_interleave(G, 0)
    mask = prompt_mask.repeat_interleave(G, 0)
    logits = out.logits[:, -1, :].to(dtype=torch.float32).repeat_interleave(G, 0)
    unfinished = torch.ones(B * G, dtype=torch.long, device=ids.device)
    for step in range(config.max_new_tokens):
        scores = processors(ids, logits)
        if config.do_sample:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = scores.argmax(dim=-1)
        tokens = tokens * unfinished + pad * (1 - unfinished)
        ids = torch.cat([ids, tokens[:, None]], dim=1)
        unfinished = unfinished & ~torch.isin(tokens, stops)
        if not unfinished.any() or step == config.max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(B * G, 1)], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position + step,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :].to(dtype=torch.float32)
    return ids[:, P:]
