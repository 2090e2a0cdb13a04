"""``qwenvl-prep fix-config --flatten``: a nested config becomes one that a real transformers 4.49 (the flat-layout
readers are 4.49 to 4.51) accepts."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from qwenvl_prep.cli import main

READER = """
import sys
from transformers import AutoConfig, GenerationConfig
config = AutoConfig.from_pretrained(sys.argv[1])
GenerationConfig.from_model_config(config)
print("OK", config.hidden_size, config.vision_config.hidden_size, config.rope_scaling["mrope_section"])
"""


def read_with(python: Path, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", READER, str(folder)], capture_output=True, text=True)


def report(capsys, *args) -> tuple[int, dict]:
    code = main(["fix-config", *map(str, args)])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_nested_to_flat_for_old_readers(tiny_model, old_transformers, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    original = (folder / "config.json").read_text()
    failed = read_with(old_transformers, folder)
    assert failed.returncode != 0 and "'dict' object has no attribute 'to_dict'" in failed.stderr
    code, before = report(capsys, folder)
    assert code == 0 and before["layout"] == "nested" and not before["readable_by_transformers_le_4_51"]
    assert before["sub_config_types"] == {"text_config": "qwen2_5_vl_text", "vision_config": "qwen2_5_vl_vision"}
    code, after = report(capsys, folder, "--flatten")
    assert code == 0 and after["layout"] == "flat" and after["readable_by_transformers_le_4_51"]
    assert Path(after["rewrite"]["backup"]).read_text() == original
    assert any("rope_scaling" in change for change in after["rewrite"]["changes"])
    ok = read_with(old_transformers, folder)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.split() == ["OK", "64", "32", "[2,", "3,", "3]"]
    from transformers import AutoConfig, AutoModelForImageTextToText

    new, old = AutoConfig.from_pretrained(folder), AutoConfig.from_pretrained(tiny_model)
    assert new.text_config.hidden_size == old.text_config.hidden_size
    assert new.text_config.rope_parameters["mrope_section"] == old.text_config.rope_parameters["mrope_section"]
    AutoModelForImageTextToText.from_pretrained(folder)
    code, again = report(capsys, folder, "--flatten")
    assert again["rewrite"] == {"changed": False, "backup": None, "changes": ["already flat: nothing to do"]}


def test_bounds_against_yaml(tiny_model, tmp_path, capsys):
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text("template: qwen2_vl\nimage_min_pixels: 200704\nimage_max_pixels: 802816\n")
    code, result = report(capsys, tiny_model, "--yaml", yaml_path)
    assert code == 1
    assert "differ from the training YAML's 200704..802816" in result["problems"][0]
