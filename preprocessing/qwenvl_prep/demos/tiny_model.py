"""Offline builder for tiny random-weight Qwen-VL checkpoints (real architecture, real tokenizer and processor).

No model hub is reachable from CI or from a user's air-gapped box, yet a CPU smoke test of the whole pipeline
(convert -> ``llamafactory-cli train`` -> export -> predict) needs a model that LLaMA-Factory loads like the real one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llamafactory_qwenvl_patch.frame.families import FAMILIES, MERGE_SIZE
from llamafactory_qwenvl_patch.model_files.portable import QWEN2_SPLIT
from qwenvl_prep.plumbing.outputs import require_new_folder

QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL's own chat template (images and videos as content parts), so HF-side chat formatting works too.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    'Locate the red square and output its bbox coordinates in JSON format: [{"bbox_2d": [12, 34, 56, 78], '
    '"label": "red square"}]',
    '```json\n[{"point_2d": [100, 200], "label": "blue circle"}]\n```',
    "Invoice number INV-2024-0017, date 2024-03-05, total amount 1,234.50 EUR.",
    "Detect every object in the image: person, car, dog, cat, bicycle, traffic light, green triangle.",
    "0123456789 ()[]{}<>,.:;'\"-_+=*/\\ abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "You are a helpful assistant. system user assistant",
]

# Model sizes: ``tiny`` for tests (fast), ``small`` for the demo (~1M parameters: enough to learn to localise).
SIZES = {
    "tiny": dict(hidden=64, layers=2, vision_hidden=32),
    "small": dict(hidden=128, layers=4, vision_hidden=64),
}
# RoPE base: with head sizes of 16-32, the real models' 1e6 (5e6 for Qwen3-VL) leaves the width axis of M-RoPE almost
# unrotated, so image positions cannot be learned; a base of 10 rotates every section (measured: predicted-vs-true
# box corner correlation .20/.07/.54/.47 at 1e6, .73/.72/.75/.82 at 10).
ROPE_THETA = 10.0



def build_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on a small embedded corpus, with the Qwen special tokens and the real Qwen2
    tokenizer's pipeline (NFC, its pre-tokenizer split: digits one by one), so every transformers reads it as it
    reads a real Qwen-VL tokenizer."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS * 4, trainer=trainer)
    cls = PreTrainedTokenizerFast
    if int(transformers.__version__.split(".")[0]) < 5:  # 4.x processors insist on the Qwen2 class
        cls = transformers.Qwen2TokenizerFast
    return cls(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=QWEN_SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )


def _set_rope(text: dict, theta: float, section: list[int], **extra: object) -> None:
    """M-RoPE settings in the installed transformers' own keys (5.x: ``rope_parameters``; 4.x: ``rope_theta`` and
    ``rope_scaling``), so the checkpoint is what that version writes for a real Qwen-VL."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "mrope_section": section, **extra}
    else:
        text["rope_theta"] = theta
        text["rope_scaling"] = {"type": "mrope", "rope_type": "default", "mrope_section": section, **extra}


def _qwen3_5(transformers, text: dict, token_ids: dict, vision_hidden: int, patch: int, moe: bool):
    """Qwen3.5 or Qwen3.5-MoE: the last layer full attention, the others Gated DeltaNet (the real models: 3 of every
    4), with 2 key and 4 value heads so that the linear layers' head repeat runs; attention heads of 32 (vLLM's CPU
    attention refuses 16), half of each rotated (the real models rotate a quarter of 256)."""
    head_dim = 32
    text = dict(text, head_dim=head_dim, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=2, linear_num_value_heads=4, partial_rotary_factor=0.5,
                layer_types=["linear_attention"] * (text["num_hidden_layers"] - 1) + ["full_attention"])
    rotated = head_dim // 2
    _set_rope(text, ROPE_THETA, [rotated // 8, 3 * rotated // 16, 3 * rotated // 16], mrope_interleaved=True,
              partial_rotary_factor=0.5)
    vision = dict(depth=2, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=patch, num_position_embeddings=2304)
    if moe:
        hidden = text.pop("intermediate_size") // 2
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                    shared_expert_intermediate_size=hidden)
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                               **token_ids)
        return transformers.Qwen3_5MoeForConditionalGeneration(config)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, **token_ids)
    return transformers.Qwen3_5ForConditionalGeneration(config)


@dataclass(frozen=True)
class Parts:
    """What a family's builder receives: the text config's common keys, the vision tokens' ids, the vision width and
    patch side, and the M-RoPE split of the head."""

    text: dict
    token_ids: dict
    vision_hidden: int
    patch: int
    head_dim: int
    section: list[int]


def _qwen2_5_vl(transformers, parts: Parts, moe: bool):
    text = dict(parts.text)
    _set_rope(text, ROPE_THETA, parts.section)
    vision = dict(depth=2, hidden_size=parts.vision_hidden, intermediate_size=2 * parts.vision_hidden, num_heads=2,
                  out_hidden_size=text["hidden_size"], fullatt_block_indexes=[1], window_size=112,
                  patch_size=parts.patch)
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **parts.token_ids)
    return (transformers.Qwen2_5_VLForConditionalGeneration(config), transformers.Qwen2VLImageProcessor(),
            transformers.Qwen2VLVideoProcessor(), transformers.Qwen2_5_VLProcessor)


def _qwen2_vl(transformers, parts: Parts, moe: bool):
    text = dict(parts.text)
    _set_rope(text, ROPE_THETA, parts.section)
    vision = dict(depth=2, embed_dim=parts.vision_hidden, hidden_size=text["hidden_size"], mlp_ratio=2, num_heads=2,
                  patch_size=parts.patch)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **parts.token_ids)
    return (transformers.Qwen2VLForConditionalGeneration(config), transformers.Qwen2VLImageProcessor(),
            transformers.Qwen2VLVideoProcessor(), transformers.Qwen2VLProcessor)


def _qwen3_vl(transformers, parts: Parts, moe: bool):
    text = dict(parts.text, head_dim=parts.head_dim)
    _set_rope(text, ROPE_THETA, parts.section, mrope_interleaved=True)
    vision = dict(depth=2, hidden_size=parts.vision_hidden, intermediate_size=2 * parts.vision_hidden, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=parts.patch, num_position_embeddings=2304,
                  deepstack_visual_indexes=[1])
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **parts.token_ids)
    return (transformers.Qwen3VLForConditionalGeneration(config), transformers.Qwen2VLImageProcessor(
        patch_size=parts.patch), transformers.Qwen3VLVideoProcessor(), transformers.Qwen3VLProcessor)


def _qwen3_5_parts(transformers, parts: Parts, moe: bool):
    model = _qwen3_5(transformers, dict(parts.text), parts.token_ids, parts.vision_hidden, parts.patch, moe)
    return (model, transformers.Qwen2VLImageProcessor(patch_size=parts.patch), transformers.Qwen3VLVideoProcessor(),
            transformers.Qwen3VLProcessor)


@dataclass(frozen=True)
class Builder:
    """How the tiny builder makes one family: its function, the transformers class it needs (to say which release
    has it) and whether it has a mixture-of-experts variant."""

    build: Callable[..., tuple]
    needs: str
    moe: bool = False


# one per family whose registry entry says ``tiny`` (tests/unit/prep/test_tiny_model.py keeps the two equal)
BUILDERS = {
    "qwen2_5_vl": Builder(_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration"),
    "qwen2_vl": Builder(_qwen2_vl, "Qwen2VLForConditionalGeneration"),
    "qwen3_vl": Builder(_qwen3_vl, "Qwen3VLForConditionalGeneration"),
    "qwen3_5": Builder(_qwen3_5_parts, "Qwen3_5ForConditionalGeneration", moe=True),
}


def _model_and_processor(family: str, tokenizer, size: str = "tiny", moe: bool = False):
    """Random-weight model of ``SIZES[size]`` (4 heads, 2 KV heads, vision depth 2) and its processor; ``moe``: the
    family's mixture-of-experts variant."""
    import transformers

    if family not in FAMILIES or not FAMILIES[family].tiny or family not in BUILDERS:
        raise ValueError(f"the tiny builder makes {', '.join(f for f in FAMILIES if FAMILIES[f].tiny)}, not {family!r}")
    builder = BUILDERS[family]
    if moe and not builder.moe:
        raise ValueError(f"the tiny builder makes a mixture-of-experts model for "
                         f"{', '.join(f for f, b in BUILDERS.items() if b.moe)} only, not {family!r}")
    if not hasattr(transformers, builder.needs):
        raise RuntimeError(f"transformers {transformers.__version__} has no {builder.needs}; install >= "
                           f"{FAMILIES[family].since_transformers}")
    dims = SIZES[size]
    hidden = dims["hidden"]
    head_dim = hidden // 4
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=dims["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    token_ids = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    parts = Parts(text, token_ids, dims["vision_hidden"], FAMILIES[family].factor // MERGE_SIZE, head_dim,
                  [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16])  # t/h/w split of head_dim / 2, as Qwen's
    model, image_processor, video_processor, processor_cls = builder.build(transformers, parts, moe)
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    return model, processor


def build_tiny_model(out_dir: str | os.PathLike, family: str = "qwen2_5_vl", seed: int = 0,
                     size: str = "tiny", moe: bool = False) -> Path:
    """Write a loadable tiny checkpoint to ``out_dir`` (atomically: built in a temp folder, then renamed)."""
    import torch

    out = Path(out_dir)
    require_new_folder(out)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, not {size!r}")
    model, processor = _model_and_processor(family, tokenizer, size, moe)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp") as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (Path(tmp) / "tiny_model.json").write_text(json.dumps({"family": family, "seed": seed, "size": size,
                                                                "moe": moe}) + "\n")
        os.chmod(tmp, 0o755)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        os.makedirs(tmp)  # TemporaryDirectory cleanup expects its folder
    return out
