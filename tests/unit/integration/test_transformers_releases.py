"""Issue 49, item 5: the transformers releases inside the requirements that are wrong or crash.

- 5.3.0 to 5.5.4 give Qwen2/2.5-VL wrong positions: a pinned or GRPO run of those families stops when its keys are
  parsed (``pyproject.toml`` refuses them too: ``tests/test_packaging.py``).
- 5.6.0's ``flash_attention_forward`` calls ``s_aux.to`` on None, so ``flash_attn: fa2`` crashed on the first
  forward. Under the plugin it gets 5.6.2's guard. This machine has no flash-attn kernel: transformers' own code runs
  from the attention layer down to the kernel's entry points (``flash_attn_func``, ``flash_attn_varlen_func``),
  which are replaced by recorders that compute the same attention with torch's SDPA.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from llamafactory_qwenvl_patch.integration.transformers_releases import (
    TransformersReleaseError, guard_flash_attention_sinks, position_problems,
)

ROOT = Path(__file__).resolve().parents[3]
ON_5_6_0 = pytest.mark.skipif(transformers.__version__ != "5.6.0", reason="the None-sink crash is 5.6.0's")
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16


@pytest.mark.parametrize("version, wrong", [
    ("5.2.0", []), ("5.3.0", ["#45325", "#45381"]), ("5.5.3", ["#45325", "#45381"]), ("5.5.4", ["#45381"]),
    ("5.6.0", []), ("4.57.6", []),
])
def test_each_release_is_named_with_what_it_gets_wrong(version, wrong):
    named = " ".join(position_problems(version))
    assert [issue for issue in ("#45325", "#45381") if issue in named] == wrong


@pytest.mark.parametrize("version, template, refused", [
    ("5.5.4", "qwen2_vl", "every video frame gets the same temporal position"),
    ("5.3.0", "qwen2_vl", "still images get temporal position 2 x their start"),
    ("5.5.4", "qwen3_vl_nothink", None),
    (transformers.__version__, "qwen2_vl", None),
])
def test_a_qwen2_run_on_a_release_with_wrong_positions_stops_when_parsed(monkeypatch, tmp_path, version, template,
                                                                          refused):
    """A user who forced such a release in (``--no-deps``) is refused by LF's own parser, before anything loads
    (the model named here does not exist); Qwen3-VL, whose positions those releases compute right, trains."""
    from llamafactory.hparams import get_train_args

    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)  # the module LF's import left there
    args = {"model_name_or_path": str(tmp_path / "no-model"), "template": template, "stage": "sft",
            "do_train": True, "output_dir": str(tmp_path / "out"), "dataset": "unused", "qwenvl_patch": True}
    if refused is None:
        assert get_train_args(args)[0].qwenvl_patch is True
        return
    with pytest.raises(TransformersReleaseError, match=f"transformers {version} computes Qwen2-VL and Qwen2.5-VL "
                       f"positions wrong .*{refused}.*excludes transformers 5.3.0 to 5.5.4. Install the tested set"):
        get_train_args(args)


@pytest.fixture
def pristine(monkeypatch) -> object:
    """transformers' ``flash_attention_forward`` as installed; whatever the guard rebinds is put back after."""
    from transformers.integrations import flash_attention
    from transformers.modeling_utils import AttentionInterface

    original = flash_attention.flash_attention_forward
    assert getattr(original, "__qwenvl_unpatched__", None) is None, "an earlier test left the guard in place"
    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("transformers"):
            for attr, value in list(vars(module).items()):
                if value is original:
                    monkeypatch.setattr(module, attr, value)
    return original


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None) -> torch.Tensor:
    """Attention over one (sequence, heads, dim) block, key/value heads shared as flash attention shares them."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=causal, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.fixture
def kernel(monkeypatch) -> list[dict]:
    """The flash-attention-2 entry points transformers loads (``_lazy_imports``), recorded: their calls are listed,
    and they answer what the kernel computes. ``s_aux`` is in their signature as in the FA3 build vLLM ships, so a
    sink reaches them when there is one."""
    from transformers import modeling_flash_attention_utils as fa_utils

    calls: list[dict] = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False, s_aux=None):
        calls.append({"kernel": "dense", "q": q, "k": k, "v": v, "causal": causal, "s_aux": s_aux})
        return torch.stack([_sdpa(q[b], k[b], v[b], causal, softmax_scale) for b in range(q.size(0))])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None, s_aux=None):
        calls.append({"kernel": "varlen", "q": q, "k": k, "v": v, "causal": causal, "s_aux": s_aux})
        bounds = cu_seqlens_q.tolist()
        return torch.cat([_sdpa(q[a:b], k[a:b], v[a:b], causal, softmax_scale) for a, b in zip(bounds, bounds[1:])])

    for name, value in {"_loaded_implementation": "flash_attention_2", "_flash_fn": flash_attn_func,
                        "_flash_varlen_fn": flash_attn_varlen_func, "_pad_fn": fa_utils._pad_input,
                        "_unpad_fn": fa_utils._unpad_input,
                        "_process_flash_kwargs_fn": fa_utils._lazy_define_process_function(flash_attn_varlen_func),
                        }.items():
        monkeypatch.setattr(fa_utils, name, value)
    return calls


def tiny_qwen2_5_vl() -> torch.nn.Module:
    """A two-layer Qwen2.5-VL in bf16 (flash attention's dtype), random weights, attention as transformers picks."""
    torch.manual_seed(0)
    text = {"vocab_size": 64, "hidden_size": HEADS * HEAD_DIM, "intermediate_size": 128, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "fullatt_block_indexes": [0]}
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    return transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).eval()


@ON_5_6_0
def test_fa2_on_5_6_0_crashes_without_the_guard_and_computes_sdpas_answer_with_it(pristine, kernel):
    model = tiny_qwen2_5_vl()
    ids = torch.tensor([[5, 9, 14, 3, 27, 8, 11, 2], [7, 1, 30, 4, 6, 0, 0, 0]])
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])  # a padded batch: the varlen kernel, as in training
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits  # sdpa
        model.config.text_config._attn_implementation = "flash_attention_2"
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'to'"):
            model(input_ids=ids, attention_mask=mask)  # the bug: transformers#45588
        assert kernel == []

        assert guard_flash_attention_sinks() is True
        assert guard_flash_attention_sinks() is True  # once only
        got = model(input_ids=ids, attention_mask=mask).logits
        single = model(input_ids=ids[:1]).logits  # no padding: the dense kernel
    assert [call["kernel"] for call in kernel] == ["varlen"] * LAYERS + ["dense"] * LAYERS
    for call in kernel:
        tokens = (13,) if call["kernel"] == "varlen" else (1, 8)  # 8 + 5 real tokens, unpadded
        assert call["q"].shape == (*tokens, HEADS, HEAD_DIM) and call["k"].shape == (*tokens, KV_HEADS, HEAD_DIM)
        assert call["v"].shape == call["k"].shape and call["causal"] is True and call["s_aux"] is None
        assert {call[t].dtype for t in "qkv"} == {torch.bfloat16}
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(single[0], expected[0], atol=2e-2, rtol=2e-2)


@ON_5_6_0
def test_the_guard_still_hands_a_real_sink_to_the_kernel_in_the_query_dtype(pristine, kernel):
    """5.6.2's guard changes nothing for a model with attention sinks (gpt-oss): the sink is cast to the query's
    half precision, as flash attention needs."""
    from transformers.integrations import flash_attention

    attention = tiny_qwen2_5_vl().model.language_model.layers[0].self_attn
    attention.config._attn_implementation = "flash_attention_2"
    q, k, v = (torch.randn(1, heads, 6, HEAD_DIM, dtype=torch.bfloat16) for heads in (HEADS, KV_HEADS, KV_HEADS))
    sink = torch.randn(HEADS, dtype=torch.float32)
    guard_flash_attention_sinks()
    flash_attention.flash_attention_forward(attention, q, k, v, None, s_aux=sink)
    assert kernel[0]["s_aux"].dtype == torch.bfloat16 and torch.equal(kernel[0]["s_aux"], sink.to(torch.bfloat16))


@pytest.mark.slow
@ON_5_6_0
def test_a_pinned_fa2_model_loaded_by_lf_gets_the_guard(tiny_model, pristine, kernel):
    """The wiring: LF's own loader, under ``qwenvl_patch: true`` and ``flash_attn: fa2``, guards the function before
    the model loads (on this CPU LF then keeps sdpa, flash-attn not being installed; the layers are switched to
    flash attention after to run it)."""
    from llamafactory.hparams import get_infer_args
    from llamafactory.model import load_model, load_tokenizer
    from transformers.modeling_utils import AttentionInterface

    model_args, _, finetuning_args, _ = get_infer_args({
        "model_name_or_path": str(tiny_model), "template": "qwen2_vl", "qwenvl_patch": True, "flash_attn": "fa2",
        "image_max_pixels": 65536})
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("llamafactory").addHandler(handler)  # LF's loggers do not propagate to pytest's
    try:
        model = load_model(load_tokenizer(model_args)["tokenizer"], model_args, finetuning_args)
    finally:
        logging.getLogger("llamafactory").removeHandler(handler)
    assert AttentionInterface._global_mapping["flash_attention_2"].__qwenvl_unpatched__ is pristine
    assert any("flash_attention_forward gets the None check of 5.6.2" in line for line in logged), logged
    model.config.text_config._attn_implementation = "flash_attention_2"
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 9, 14, 3]]))
    assert len(kernel) == model.config.text_config.num_hidden_layers


def test_the_guard_leaves_transformers_4_57_alone(transformers_457):
    """The second tested set has no sink argument at all: the guard changes nothing there."""
    probe = ("from transformers.integrations import flash_attention as f; before = f.flash_attention_forward; "
             "from llamafactory_qwenvl_patch.integration.transformers_releases import guard_flash_attention_sinks; "
             "print(guard_flash_attention_sinks(), f.flash_attention_forward is before)")
    result = subprocess.run([str(transformers_457), "-c", probe], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["False", "True"]
