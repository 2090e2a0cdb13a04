"""The two stages ``qwenvl-prep curriculum`` writes, trained in order through ``llamafactory-cli train``; the second
stage's dataset under the first stage's frame is refused by the training guard."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import read_log, run_cli, write_curriculum

from qwenvl_prep.cli import main


@pytest.mark.slow
def test_two_stages_train_in_order_and_the_wrong_data_is_refused(tiny_model, tmp_path, capsys):
    args = write_curriculum(tmp_path, tiny_model)
    assert main(args) == 0
    capsys.readouterr()
    stages = [yaml.safe_load((tmp_path / "cur" / f"stage{k}.yaml").read_text()) for k in (1, 2)]
    for k, stage in enumerate(stages, 1):
        result = run_cli(["llamafactory-cli", "train", str(tmp_path / "cur" / f"stage{k}.yaml")], None,
                         tmp_path / f"run{k}")
        assert result.returncode == 0, result.stderr[-4000:]
        assert [row for row in read_log(Path(stage["output_dir"])) if "loss" in row]
    second = stages[1]
    assert (Path(second["output_dir"]) / "adapter_model.safetensors").is_file()
    wrong = {**second, "dataset": "train_stage1", "output_dir": str(tmp_path / "wrong")}
    result = run_cli(["llamafactory-cli", "train"], wrong, tmp_path / "run-wrong")
    assert result.returncode != 0
    assert "was converted for another frame" in result.stdout + result.stderr
