"""The grounding demo learns (its own file, so that the test workers run it beside the demo smoke runs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import run_cli

DEMO_PAGE = Path(__file__).resolve().parents[1] / "docs" / "getting-started.md"  # the demo tables
CPU_SPREAD = (0.05, 0.03)  # (Acc@0.5, mean IoU): how far another CPU model may move the seeded numbers


def readme_row(label: str) -> tuple[float, float]:
    """(Acc@0.5, mean IoU) of a row of the grounding demo table (docs/getting-started.md)."""
    match = re.search(rf"^\| {re.escape(label)} \| ([0-9.]+) \| ([0-9.]+) \|", DEMO_PAGE.read_text(), re.MULTILINE)
    assert match, f"docs/getting-started.md has no demo row {label!r}"
    return float(match.group(1)), float(match.group(2))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_default_demo_learns_to_localise(tmp_path):
    """The main job as a user runs it (a fixed step count, so no timing enters): on held-out images the trained model
    beats the constant mean-box baseline of the same run by the margins the docs state, and the untrained model."""
    out = tmp_path / "learn"
    result = run_cli(["qwenvl-prep", "demo", str(out)], None, tmp_path, timeout=1500)  # 4 min alone, 10 under load
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    trained, baseline, untrained = (summary["held_out"][name] for name in ("trained", "baseline", "untrained"))
    assert summary["held_out_images"] == 100 and baseline["acc@0.5"] > 0
    assert trained["mean_iou"] >= 2 * baseline["mean_iou"], summary
    assert trained["acc@0.5"] >= 5 * baseline["acc@0.5"], summary
    assert trained["mean_centre_offset_orig_px"] < baseline["mean_centre_offset_orig_px"]
    assert untrained["acc@0.5"] < baseline["acc@0.5"] and trained["parse_failure_rate"] <= 0.05
    assert summary["sft_loss_first_last"][1] < summary["sft_loss_first_last"][0] / 5
    # the demo is deterministic for a seed on one machine (its training and predictions run on one torch thread), and
    # within CPU_SPREAD of the docs' row across CPU models (float kernels differ by instruction set: the row's machine
    # 0.56 / 0.543, an AVX2 EPYC 0.58 / 0.526): a change that moves its numbers further must update the row
    for name, label in (("trained", "Qwen2.5-VL trained (SFT + GRPO)"), ("baseline", "Qwen2.5-VL mean-box baseline")):
        measured = summary["held_out"][name]
        row = readme_row(label)
        assert abs(measured["acc@0.5"] - row[0]) <= CPU_SPREAD[0] + 1e-9, (label, row, summary)
        assert abs(measured["mean_iou"] - row[1]) <= CPU_SPREAD[1] + 1e-9, (label, row, summary)
