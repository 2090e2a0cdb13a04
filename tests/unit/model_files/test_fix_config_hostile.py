"""fix-config on odd files (issue 33, class 5): a config.json that is not an object, invalid JSON, a list
model_type, a text_config that is a string and rope settings that are not an object are each one error or problem
naming the file and key, never a traceback or a success; --flatten takes text_config's values over stale top-level
copies (the model is built from them)."""

from __future__ import annotations

import json
import shutil

import pytest

from qwenvl_prep.cli import main


@pytest.fixture()
def folder(tiny_model, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_model, out)
    return out


def edit_config(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(change(config) if callable(change) else change)


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "a JSON object was expected, found list"),
    ("null", "a JSON object was expected, found NoneType"),
    ('{"model_type": "qwen2_5_vl",', "not readable JSON"),
])
def test_a_config_that_is_not_an_object_is_one_error_naming_it(folder, capsys, text, message):
    (folder / "config.json").write_text(text)
    assert main(["fix-config", str(folder)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(folder / "config.json") in err and "Traceback" not in err


def test_a_list_model_type_and_a_string_text_config_are_problems(folder, capsys):
    edit_config(folder, lambda c: json.dumps({**c, "model_type": ["qwen2_5_vl"]}))
    assert main(["fix-config", str(folder)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any("is not a Qwen-VL type" in line for line in report["problems"])
    edit_config(folder, lambda c: json.dumps({**c, "model_type": "qwen2_5_vl", "text_config": "oops"}))
    assert main(["fix-config", str(folder)]) == 1
    assert any("text_config is \"oops\", not an object" in line
               for line in json.loads(capsys.readouterr().out)["problems"])
    before = (folder / "config.json").read_text()
    assert main(["fix-config", str(folder), "--flatten"]) == 2
    assert "text_config is \"oops\", not an object" in capsys.readouterr().err
    assert (folder / "config.json").read_text() == before


@pytest.mark.parametrize("rope", [None, "default"])
def test_flatten_refuses_rope_settings_it_cannot_carry(folder, capsys, rope):
    def change(config):
        config["text_config"]["rope_parameters"] = rope
        return json.dumps(config)

    edit_config(folder, change)
    before = (folder / "config.json").read_text()
    assert main(["fix-config", str(folder), "--flatten"]) == 2
    assert "rope_parameters is" in capsys.readouterr().err and (folder / "config.json").read_text() == before


def test_flatten_takes_text_configs_values_over_stale_top_level_copies(folder, capsys):
    def change(config):
        config["hidden_size"] = 999  # a stale top-level copy
        return json.dumps(config)

    edit_config(folder, change)
    text_hidden = json.loads((folder / "config.json").read_text())["text_config"]["hidden_size"]
    assert main(["fix-config", str(folder), "--flatten"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    flat = json.loads((folder / "config.json").read_text())
    assert flat["hidden_size"] == text_hidden != 999 and "text_config" not in flat
    assert any("replaces the top level's hidden_size=999" in line for line in report["rewrite"]["changes"])
