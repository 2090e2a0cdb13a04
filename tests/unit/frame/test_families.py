"""The family registry: one place for everything that differs between Qwen-VL generations."""

from __future__ import annotations

import json

import pytest
from helpers import save_image

from llamafactory_qwenvl_patch.frame.families import FAMILIES, Family, register, resolve_family


@pytest.fixture()
def qwen9():
    """A made-up next generation: factor 56, relative coordinates, its own model type and template."""
    family = register(Family("qwen9_vl", 56, "rel1000", ("qwen9_vl",), ("qwen9",), "Qwen3VLPlugin", "qwen9"))
    yield family
    del FAMILIES["qwen9_vl"]


def test_resolution_order(tmp_path, qwen9):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert resolve_family(model, "qwen9_vl").name == "qwen2_5_vl"  # the checkpoint wins over the template
    assert resolve_family(tmp_path / "hub/name", "qwen9_vl").name == "qwen9_vl"
    assert resolve_family(None, "qwen2_vl").name == "qwen2_5_vl"  # LF's qwen2_vl template serves Qwen2.5-VL
    assert resolve_family(None, "qwen3_vl_nothink").name == "qwen3_vl"
    assert resolve_family(None, "unknown", factor=56).name == "qwen9_vl"
    assert resolve_family().name == "qwen2_5_vl"
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    assert resolve_family(model).name == "qwen2_vl"


def test_a_new_family_is_one_registration_away(tmp_path, qwen9, capsys):
    """Registered in one place, the family reaches the CLI's choices, the policy (factor 56), convert's
    conventions and the stamp."""
    from llamafactory_qwenvl_patch.scoring.answers import parse_items
    from qwenvl_prep.cli import main

    save_image(tmp_path / "wide.jpg", 2000, 1000)
    (tmp_path / "in.jsonl").write_text(json.dumps({"image": "wide.jpg", "question": "Where?",
                                                   "answer": '[{"bbox_2d": [0, 0, 1000, 500]}]'}) + "\n")
    out = tmp_path / "data" / "t.jsonl"
    assert main(["convert", str(tmp_path / "in.jsonl"), "-o", str(out), "--input-coords", "abs", "--family",
                 "qwen9_vl", "--min-pixels", str(56 * 56 * 4), "--max-pixels", str(56 * 56 * 64), "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["stamp"]["factor"], summary["stamp"]["coords"], summary["stamp"]["family"]) == (
        56, "rel1000", "qwen9_vl")
    [item] = parse_items(json.loads(out.read_text().splitlines()[0])["messages"][1]["content"])
    assert item.coords == (0, 0, 500, 500)  # relative 0-1000, whatever the factor
    stamp = json.loads((out.parent / "dataset_info.json").read_text())["t"]["qwenvl_policy"]
    assert stamp["factor"] == 56


@pytest.mark.parametrize("model_type, family", [("qwen3_5", "qwen3_5"), ("qwen3_5_moe", "qwen3_5"),
                                                ("qwen3_vl_moe", "qwen3_vl"), ("qwen3_vl", "qwen3_vl")])
def test_qwen3_5_and_the_moe_checkpoints_decide_their_family(tmp_path, model_type, family):
    """The checkpoint alone: no template is needed (a Qwen3.5 run without one used to get Qwen2.5-VL's frame)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    resolved = resolve_family(tmp_path)
    assert (resolved.name, resolved.factor, resolved.coords) == (family, 32, "rel1000")
    assert resolve_family(tmp_path, "qwen2_vl").name == family


def test_qwen3_5_templates():
    for template in ("qwen3_5", "qwen3_5_nothink", "qwen3_6"):
        assert resolve_family(None, template).name == "qwen3_5"
    assert resolve_family(None, "qwen3_vl").name == "qwen3_vl"


def test_every_family_names_its_hub_processor_bounds():
    """Stock LF's second resize is the hub processor's: Qwen2-VL and Qwen2.5-VL keep the bounds the audit always
    used; Qwen3-VL and Qwen3.5 have their own (patch 16), for images and for videos over the whole clip."""
    from qwenvl_prep.lf.drift import processor_bounds

    assert all(f.hub_image_bounds and f.hub_video_bounds for f in FAMILIES.values())
    for name in ("qwen2_vl", "qwen2_5_vl"):
        assert processor_bounds(None, name) == FAMILIES[name].hub_video_bounds == (3136, 12845056)
    for name in ("qwen3_vl", "qwen3_5"):
        assert processor_bounds("Qwen/not-a-folder", name) == (65536, 16777216)
        assert FAMILIES[name].hub_video_bounds == (4096, 25165824)


@pytest.mark.parametrize("template, family, bounds", [("qwen2_vl", "qwen2_5_vl", [3136, 12845056]),
                                                      ("qwen3_vl_nothink", "qwen3_vl", [65536, 16777216]),
                                                      ("qwen3_5_nothink", "qwen3_5", [65536, 16777216])])
def test_check_without_a_model_folder_audits_with_the_familys_hub_processor(tmp_path, capsys, template, family,
                                                                             bounds):
    """A YAML naming a hub model (no folder to read the processor from): the drift audit resizes as that family's
    hub processor does, not as Qwen2.5-VL's (every family used to get Qwen2.5-VL's bounds)."""
    from qwenvl_prep.cli import main

    factor = FAMILIES[family].factor
    save_image(tmp_path / "photo.jpg", 1600, 1200)
    (tmp_path / "in.jsonl").write_text(json.dumps({"image": "photo.jpg", "question": "Where?",
                                                   "answer": '[{"bbox_2d": [10, 10, 800, 600]}]'}) + "\n")
    flags = ["--min-pixels", str(4 * factor * factor), "--max-pixels", str(64 * factor * factor)]
    assert main(["convert", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "data" / "g.json"), "--input-coords",
                 "abs", "--family", family, *flags, "-q", "--workers", "1"]) == 0
    capsys.readouterr()
    yaml = tmp_path / "train.yaml"
    yaml.write_text(f"model_name_or_path: Qwen/hub-model\ntemplate: {template}\nqwenvl_patch: true\ndataset: g\n"
                    f"dataset_dir: {tmp_path / 'data'}\nimage_min_pixels: {flags[1]}\nimage_max_pixels: {flags[3]}\n")
    assert main(["check", "--yaml", str(yaml), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["drift"]["stock_processor_bounds"] == bounds
