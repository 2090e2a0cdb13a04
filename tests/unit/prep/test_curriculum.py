"""``qwenvl-prep curriculum``: per-stage frames, stamps the training guard accepts only in their stage, YAMLs that
resume the previous stage (the two stages run through ``llamafactory-cli train`` in
tests/cli/test_curriculum_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import CURRICULUM_BOX, CURRICULUM_STAGES, write_curriculum

from llamafactory_qwenvl_patch.scoring.answers import parse_items
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from qwenvl_prep.cli import main

LOW, HIGH = CURRICULUM_STAGES
BOX = CURRICULUM_BOX


@pytest.fixture()
def curriculum(tmp_path, tiny_model, capsys):
    args = write_curriculum(tmp_path, tiny_model)
    capsys.readouterr()
    assert main(args) == 0
    return tmp_path, json.loads(capsys.readouterr().out)


def stage_config(root: Path, k: int) -> dict:
    return yaml.safe_load((root / "cur" / f"stage{k}.yaml").read_text())


def test_each_stage_has_its_frame_and_resumes_the_previous(curriculum):
    root, summary = curriculum
    first, second = stage_config(root, 1), stage_config(root, 2)
    assert (first["image_max_pixels"], second["image_max_pixels"]) == (LOW, HIGH)
    assert first["dataset"] == "train_stage1" and second["dataset"] == "train_stage2"
    assert "adapter_name_or_path" not in first and second["adapter_name_or_path"] == first["output_dir"]
    assert summary["run"].count("llamafactory-cli train") == 2
    for k, max_pixels in ((1, LOW), (2, HIGH)):
        policy = ResizePolicy(32 * 28 * 28, max_pixels, 28)
        h, w = policy.model_size(1000, 2000)
        rows = [json.loads(line) for line in (root / "cur" / "data" / f"train_stage{k}.jsonl").read_text().splitlines()]
        [item] = parse_items(rows[0]["messages"][1]["content"])
        assert item.coords == tuple(round(v * s) for v, s in zip(BOX, (w / 2000, h / 1000, w / 2000, h / 1000)))
    low = parse_items(json.loads((root / "cur" / "data" / "train_stage1.jsonl").read_text().splitlines()[0])
                      ["messages"][1]["content"])
    assert low[0].coords != item.coords  # the two frames really differ for this image


def test_the_stamp_guard_accepts_each_stage_only_in_its_own_frame(curriculum, tiny_model):
    from llamafactory_qwenvl_patch.integration.data_patch import StampMismatchError, check_dataset_stamps

    root, _ = curriculum
    model_args = SimpleNamespace(model_name_or_path=str(tiny_model))
    for k in (1, 2):
        config = stage_config(root, k)
        policy = ResizePolicy(config["image_min_pixels"], config["image_max_pixels"], 28)
        mine = SimpleNamespace(dataset=[config["dataset"]], eval_dataset=None, dataset_dir=config["dataset_dir"],
                               template="qwen2_vl")
        check_dataset_stamps(model_args, mine, policy)
        other = SimpleNamespace(**{**vars(mine), "dataset": [f"train_stage{3 - k}"]})
        with pytest.raises(StampMismatchError, match="was converted for another frame"):
            check_dataset_stamps(model_args, other, policy)


def test_bad_stage_lists_and_existing_yamls_are_refused(curriculum, capsys):
    root, _ = curriculum
    args = ["curriculum", str(root / "raw" / "train.jsonl"), "--from-yaml", str(root / "base.yaml"), "-o",
            str(root / "cur"), "--input-coords", "abs", "-q", "--workers", "1"]
    assert main([*args, "--stages", f"{HIGH},{LOW}"]) == 2
    assert "low to high" in capsys.readouterr().err
    assert main([*args, "--stages", str(LOW)]) == 2
    assert main([*args, "--stages", f"{LOW},{HIGH}"]) == 2
    assert "--overwrite" in capsys.readouterr().err
