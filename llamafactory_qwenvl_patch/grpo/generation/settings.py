"""Sampling settings for GRPO rollouts: the distribution sampled must be the one whose log-probs are optimised.

LF's generating defaults (``top_p 0.7``, ``top_k 50``) suit chat, not RL: completions drawn from a truncated
distribution while the loss and the KL use the full softmax give a biased gradient. Under ``stage: grpo`` the
defaults are no truncation; values the user sets explicitly are kept, with one warning. The vision tokens are
suppressed in sampling and in the log-probs alike, and the run's generation config replaces the checkpoint's
during ``generate``, so no ``generation_config.json`` (Qwen2.5-VL ships ``top_k 1``) can leak in on any
transformers version.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

NEUTRAL = {"top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def sampling_settings(generating_args: Any, explicit: set[str]) -> tuple[dict[str, Any], list[str]]:
    """(temperature, top_p, top_k, repetition_penalty and max_new_tokens for ``GenerationConfig``, warnings)."""
    if getattr(generating_args, "num_beams", 1) != 1:
        raise ValueError("stage: grpo samples completions: num_beams must be 1")
    temperature = float(generating_args.temperature or 0.0)
    if temperature <= 0:
        raise ValueError("stage: grpo samples completions: set temperature > 0")
    settings: dict[str, Any] = {"temperature": temperature}
    warnings = []
    for key, neutral in NEUTRAL.items():
        value = getattr(generating_args, key)
        if key not in explicit or value is None:
            settings[key] = neutral
            continue
        settings[key] = value
        if value != neutral and not (key == "top_k" and value <= 0):
            warnings.append(f"{key}={value}: GRPO samples from a reshaped distribution while the loss and the KL use "
                            f"the full softmax at temperature {temperature}; the policy gradient is biased and the "
                            f"KL estimate is no longer unbiased. Remove {key} (default {neutral}) unless you mean it.")
    if not generating_args.max_new_tokens or generating_args.max_new_tokens <= 0:
        raise ValueError("stage: grpo needs max_new_tokens > 0: it bounds every completion (and dr_grpo's constant)")
    settings["max_new_tokens"] = int(generating_args.max_new_tokens)
    return settings, warnings


def vision_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the vision placeholder tokens a completion must never contain (one more image token breaks the
    forward: 'Image features and image tokens do not match')."""
    ids = [tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS]
    return sorted({i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id and i >= 0})


@contextmanager
def generation_config_of(model: Any, config: Any) -> Iterator[None]:
    """Make ``config`` the model's own generation config for the duration of a ``generate`` call."""
    saved = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved
