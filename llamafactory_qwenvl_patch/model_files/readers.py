"""What a given reader cannot load in a model folder, or would load differently from transformers 5.x: one line per
problem naming the reader, the file and the key, checked on the files alone (no reader needs to be installed).

Each rule was found by loading 5.x exports with the real readers (transformers 4.49.0, 4.51.3, 4.57.6; vLLM 0.11.0
on CPU); the messages quote what those readers then say or do.
"""

from __future__ import annotations

import json
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model_type
from llamafactory_qwenvl_patch.model_files.config_layout import layout, nested_only
from llamafactory_qwenvl_patch.model_files.folder import (
    CONFIG, IMAGE_PROCESSOR, PROCESSOR, TOKENIZER_CONFIG, VIDEO_PROCESSOR, ModelFolder,
)
from llamafactory_qwenvl_patch.model_files.portable import (
    GENERIC_5X_TOKENIZER_CLASS, QWEN_TOKENIZER_CLASSES, declared_bounds, key_bounds, nested,
)

READERS = {
    "transformers-4.51": "transformers 4.49 to 4.51",
    "transformers-4.57": "transformers 4.57",
    "vllm": "vLLM 0.11 (transformers 4.57)",
}
OLD = "transformers-4.51"
READER_TRANSFORMERS = {"transformers-4.51": "4.49", "transformers-4.57": "4.57", "vllm": "4.57"}  # the oldest each
SLOW_DEFAULTS = "56*56..28*28*1280"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def has_family(reader: str, family: str) -> bool:
    """Whether ``reader`` (a key of READERS) has the family's model types at all."""
    return _version(READER_TRANSFORMERS[reader]) >= _version(FAMILIES[family].since_transformers)


def _config_problems(config: dict[str, Any], reader: str) -> list[str]:
    family = family_of_model_type(config.get("model_type"))
    if family is None:
        return [f"{CONFIG}: model_type {config.get('model_type')!r} is not a Qwen-VL type"]
    if not has_family(reader, family):
        return [f"{CONFIG}: model_type {config['model_type']!r} exists only from transformers "
                f"{FAMILIES[family].since_transformers} on"]
    if layout(config) == "flat":
        return []
    text = config["text_config"]
    if reader == OLD:
        return [f"{CONFIG}: text_config: nested layout, loaded as a plain dict ('dict' object has no attribute "
                "'to_dict')"]
    found = []
    if not nested_only(config.get("model_type")) and not text.get("architectures"):
        found.append(f"{CONFIG}: architectures: read through text_config, which has none (vLLM: 'No model "
                     "architectures are specified')")
    if isinstance(text.get("rope_parameters"), dict) and not ("rope_scaling" in text and "rope_theta" in text):
        found.append(f"{CONFIG}: text_config.rope_parameters: a transformers 5.x key, ignored: rope_theta falls "
                     "back to the default and M-RoPE's mrope_section is lost (silently)")
    if "tie_word_embeddings" in config and text.get("tie_word_embeddings", config["tie_word_embeddings"]) != \
            config["tie_word_embeddings"]:
        found.append(f"{CONFIG}: text_config.tie_word_embeddings: {json.dumps(text['tie_word_embeddings'])} where "
                     f"the top level (which 5.x saved the weights by) says {json.dumps(config['tie_word_embeddings'])}"
                     ": the trained lm_head would be replaced by the embeddings")
    return found


def _tokenizer_problems(folder: ModelFolder, reader: str, chat: bool) -> list[str]:
    data = folder.get(TOKENIZER_CONFIG)
    if data is None:
        return [f"{TOKENIZER_CONFIG}: missing"]
    found = []
    cls = data.get("tokenizer_class")
    if cls == GENERIC_5X_TOKENIZER_CLASS:
        found.append(f"{TOKENIZER_CONFIG}: tokenizer_class: {cls} is a transformers 5.x name ('Tokenizer class "
                     f"{cls} does not exist or is not currently imported')")
    elif cls not in QWEN_TOKENIZER_CLASSES and reader == "vllm":
        found.append(f"{TOKENIZER_CONFIG}: tokenizer_class: {cls!r}; vLLM hands its tokenizer to the Qwen-VL "
                     f"processor, which accepts only {' or '.join(QWEN_TOKENIZER_CLASSES)}")
    if isinstance(data.get("extra_special_tokens"), list):
        found.append(f"{TOKENIZER_CONFIG}: extra_special_tokens: a list (transformers 5.x); 4.x expects a dict "
                     "('list' object has no attribute 'keys')")
    if chat and not folder.chat_template:
        found.append(f"{TOKENIZER_CONFIG}: chat_template: none in the folder (chat_template.jinja or the key), so "
                     "chat requests cannot be formatted")
    return found


def _processor_problems(folder: ModelFolder, reader: str) -> list[str]:
    image = folder.get(IMAGE_PROCESSOR)
    found = []
    if image is None:
        found.append(f"{IMAGE_PROCESSOR}: missing; transformers 4.x reads the image processor only from it "
                     f"(5.x nests it in {PROCESSOR})")
    elif key_bounds(image) is None and reader == "vllm":
        if not nested_only((folder.get(CONFIG) or {}).get("model_type")):  # vLLM reads size for Qwen3-VL
            found.append(f"{IMAGE_PROCESSOR}: max_pixels: missing; vLLM 0.11 reads image_processor.max_pixels "
                         "(None: TypeError in smart_resize at start-up)")
    elif key_bounds(image) is None:
        found.append(f"{IMAGE_PROCESSOR}: min_pixels, max_pixels: missing; the slow Qwen2VLImageProcessor of "
                     f"transformers 4.x then ignores size and resizes with its defaults ({SLOW_DEFAULTS})")
    bounds = declared_bounds(folder)
    trained = folder.record_bounds()
    if len(set(bounds.values()) | ({trained} if trained else set())) > 1:
        stated = "; ".join(f"{where} {b[0]}..{b[1]}" for where, b in bounds.items())
        record = f"; qwenvl_policy.json {trained[0]}..{trained[1]}" if trained else ""
        found.append(f"{IMAGE_PROCESSOR}: bounds disagree ({stated}{record}): readers would resize differently")
    if reader == OLD:
        found += [f"{PROCESSOR}: {key}: a nested dict (transformers 5.x); 4.49 to 4.51 pass it to the processor "
                  f"('got multiple values for argument {key!r}')"
                  for key in ("image_processor", "video_processor") if nested(folder, key) is not None]
    elif folder.get(VIDEO_PROCESSOR) is None and nested(folder, "video_processor") is not None:
        found.append(f"{VIDEO_PROCESSOR}: missing; transformers 4.57 builds the video processor from "
                     f"{IMAGE_PROCESSOR} instead of {PROCESSOR}'s video_processor")
    return found


def reader_problems(folder: ModelFolder, reader: str, chat: bool = True) -> list[str]:
    """Every problem ``reader`` (a key of READERS) has with the folder, each as 'reader: file: key: what happens'.
    ``chat``: the reader formats chat requests with the folder's own template (not so under LLaMA-Factory, whose
    template formats them)."""
    if reader not in READERS:
        raise ValueError(f"unknown reader {reader!r}; one of {', '.join(READERS)}")
    config = folder.get(CONFIG)
    found = [f"{CONFIG}: missing"] if config is None else _config_problems(config, reader)
    found += _tokenizer_problems(folder, reader, chat) + _processor_problems(folder, reader)
    return [f"{reader}: {line}" for line in found]


def all_reader_problems(folder: ModelFolder) -> dict[str, list[str]]:
    return {reader: reader_problems(folder, reader) for reader in READERS}
