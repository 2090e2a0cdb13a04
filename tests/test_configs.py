"""The shipped YAMLs parse with LF's own parser (with the plugin's keys) and the DeepSpeed JSONs are valid."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


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
