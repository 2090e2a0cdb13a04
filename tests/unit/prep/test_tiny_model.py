"""The tiny-model builder: tokenizer and position settings that behave like the real Qwen-VL where it matters."""

from __future__ import annotations

import json

import pytest
from helpers import skip_without
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from qwenvl_prep.demos.tiny_model import BUILDERS, ROPE_THETA, build_tiny_model, build_tokenizer


def test_the_builder_makes_exactly_the_families_the_registry_calls_tiny():
    """The registry says which families ``tiny-model`` makes (its CLI choices); each has a builder, and no builder
    makes a family the registry does not call tiny."""
    assert set(BUILDERS) == {name for name, family in FAMILIES.items() if family.tiny}
    with pytest.raises(ValueError, match="mixture-of-experts model for qwen3_5 only, not 'qwen2_vl'"):
        build_tiny_model("unused", "qwen2_vl", moe=True)


def test_every_digit_is_its_own_token():
    """As in Qwen2/2.5/3-VL: coordinates are spelled digit by digit, whatever their context."""
    tokenizer = build_tokenizer()
    for text, digits in (('[{"bbox_2d": [123, 45, 300, 2010]', "2123453002010"), (" 200", "200"),
                         ("INV-2024-0017", "20240017")):
        pieces = [tokenizer.decode([i]) for i in tokenizer(text)["input_ids"]]
        assert [p for p in pieces if any(c.isdigit() for c in p)] == list(digits), pieces


def rope_theta(config) -> float:
    text = config.text_config
    params = getattr(text, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(text, "rope_theta", None))


def mrope_sections(config) -> tuple[float, list[int], int]:
    text = config.text_config
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return rope_theta(config), params["mrope_section"], head_dim


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_every_mrope_section_rotates_across_an_image_grid(size, tmp_path):
    """Positions must be learnable at these head sizes: across a 9-patch-wide grid, the slowest frequency of the
    height and width sections still turns by at least half a radian (the real models' base of 1e6 gives ~0.001)."""
    theta, section, head_dim = mrope_sections(AutoConfig.from_pretrained(build_tiny_model(tmp_path / "m", size=size)))
    assert sum(section) == head_dim // 2
    slowest = {"height": section[0] + section[1] - 1, "width": sum(section) - 1}  # frequency indices
    for axis, index in slowest.items():
        assert 9 * theta ** (-2 * index / head_dim) >= 0.5, (axis, theta, section)


@pytest.mark.parametrize("family", [name for name, f in FAMILIES.items() if f.tiny])
def test_sizes_and_positions(family, tmp_path):
    skip_without(family)
    counts = {}
    for size in ("tiny", "small"):
        folder = build_tiny_model(tmp_path / size, family, size=size)
        config = AutoConfig.from_pretrained(folder)
        assert rope_theta(config) == ROPE_THETA  # the checkpoint carries the base in the installed layout
        model = AutoModelForImageTextToText.from_pretrained(folder)
        counts[size] = sum(p.numel() for p in model.parameters())
        assert json.loads((folder / "tiny_model.json").read_text())["size"] == size
        assert len(AutoTokenizer.from_pretrained(folder)("305")["input_ids"]) == 3
    assert counts["tiny"] < 500_000 and 800_000 < counts["small"] < 2_000_000  # Qwen3.5: linear heads of 128


@pytest.mark.parametrize("moe", [False, True])
def test_qwen3_5_is_hybrid_and_servable(moe, tmp_path):
    """Both layer kinds, attention heads of 32 (vLLM's CPU attention refuses 16), experts in the MoE variant; on a
    torch without a CPU grouped_mm kernel the MoE trains only with eager experts, which the loader then picks."""
    import torch

    from llamafactory_qwenvl_patch.model_files.experts import cpu_grouped_mm_runs, folder_experts_load_kwargs

    skip_without("qwen3_5")
    folder = build_tiny_model(tmp_path / "m", "qwen3_5", moe=moe)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5")
    text = config["text_config"]
    assert set(text["layer_types"]) == {"linear_attention", "full_attention"} and text["head_dim"] >= 32
    assert bool(text.get("num_experts")) == moe
    kwargs = folder_experts_load_kwargs(folder)
    assert kwargs == ({"experts_implementation": "eager"} if moe and not cpu_grouped_mm_runs() else {})
    model = AutoModelForImageTextToText.from_pretrained(folder, **kwargs)
    for param in model.parameters():  # aligned copies, as after an optimiser step
        param.data = param.data.clone()
    ids = torch.tensor([[20, 21, 22, 23, 24]] * 2)
    model(input_ids=ids, labels=ids).loss.backward()
