"""The GUI demo learns (its own file, so that the test workers run it beside the other demo runs)."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli

MIN_CLICK_ACC = 0.5


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.timeout(3600)
def test_default_gui_demo_learns_to_click(tmp_path):
    """The GUI demo as a user runs it (a fixed step count, so no timing enters): a ScreenSpot file converted,
    SFT then GRPO with click rewards, and on held-out screenshots a click accuracy at least 3x the same run's
    mean-click baseline and at least MIN_CLICK_ACC (the baseline is near 0, so 3x alone proves little), with every
    platform and element type scored."""
    from qwenvl_prep.demos.gui import HELD_OUT, SCREENS

    out = tmp_path / "gui"
    result = run_cli(["qwenvl-prep", "demo", str(out), "--task", "gui"], None, tmp_path, timeout=3300)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    click = summary["click"]
    baseline, untrained, grpo = (click[name]["overall"] for name in ("baseline", "untrained", "grpo"))
    assert summary["held_out_instructions"] == HELD_OUT == grpo["samples"]
    assert grpo["click_acc"] >= max(3 * baseline["click_acc"], MIN_CLICK_ACC), summary
    assert untrained["click_acc"] <= baseline["click_acc"] and grpo["no_click_rate"] <= 0.05, summary
    assert set(click["grpo"]["by"]) == {f"platform={platform}, data_type={kind}" for platform in SCREENS
                                        for kind in ("icon", "text")}
    record = json.loads((out / "data" / "gui_eval.json").read_text())[0]
    assert set(json.loads(record["meta"])) >= {"bbox_orig", "platform", "data_type"}
    grpo_log = [json.loads(line) for line in (out / "grpo" / "trainer_log.jsonl").read_text().splitlines()]
    assert any("rewards/click/mean" in row and "rewards/click_dense/mean" in row for row in grpo_log)
    monitors = ("click_multi_point_rate", "click_outside_rate", "click_centre_rate", "click_same_point_group_rate")
    assert any(all(f"monitor/{name}" in row for name in monitors) for row in grpo_log)  # issue 42, item 8
    assert (out / "drawn" / "gui_eval-contact-sheet-original.jpg").stat().st_size > 0
