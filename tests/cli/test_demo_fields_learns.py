"""The field-extraction demo learns (its own file, so that the test workers run it beside the other demo runs)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import run_cli

from qwenvl_prep.demos.fields import FIELDS, STAGES
from qwenvl_prep.lf.run_spec import load_yaml


GRPO_TOLERANCE = 0.025


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.timeout(3600)
def test_default_fields_demo_learns_to_read(tmp_path):
    """The field-extraction demo as a user runs it (a fixed step count, so no timing enters): curriculum stages in
    their own frames, stage 2 resuming stage 1, GRPO with the blank-image control, export, predict, and the issue's
    targets on held-out invoices against the most-common-value baseline of the same run. Seed 0 only: with
    ``--seed 1`` the SFT model already abstains on blank pages (README), so the blank target is not met there."""
    out = tmp_path / "fields"
    result = run_cli(["qwenvl-prep", "demo", str(out), "--task", "fields"], None, tmp_path, timeout=3300)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    assert [s["image_max_pixels"] for s in summary["stages"]] == list(STAGES)
    assert all(len(s["sft_loss"]) > 1 for s in summary["stages"])
    assert load_yaml(out / "curriculum" / "stage2.yaml")["model_name_or_path"] == str(out / "sft" / "stage1")
    held_out = summary["held_out"]
    assert summary["held_out_pages"] >= 50 and set(held_out) == {"untrained", "baseline", "sft", "grpo"}
    for name, metrics in held_out.items():
        assert metrics["samples"] == summary["held_out_pages"] and set(metrics["per_field_accuracy"]) == set(FIELDS)
        assert json.loads((out / f"eval-{name}.json").read_text())["fields"] == metrics
    baseline, sft, grpo = held_out["baseline"], held_out["sft"], held_out["grpo"]
    assert baseline["format_valid_rate"] == 1.0 and baseline["mean_fields_reward"] > 0
    assert held_out["untrained"]["mean_fields_reward"] < baseline["mean_fields_reward"]
    assert sft["format_valid_rate"] >= 0.9, summary
    assert grpo["mean_fields_reward"] >= 1.5 * baseline["mean_fields_reward"], summary
    assert max(grpo["per_field_accuracy"].values()) >= 0.5, summary
    # GRPO keeps what SFT read: not below SFT by more than the run-to-run variation docs/fields.md records for the
    # default seed (one run gave 0.915 after SFT and 0.895 after GRPO; the others, GRPO at or above SFT).
    assert grpo["mean_fields_reward"] >= sft["mean_fields_reward"] - GRPO_TOLERANCE, summary
    # The blank control: confident answers on blank pages, sampled at GRPO's temperature (every blank page is the same
    # grey in one frame, so the greedy rate is one bit), fall by more than twice the sampling noise of the difference
    # (Agresti-Caffo: one confident and one other answer added to each count, so that 4 of 256 -> 0 is not a fall)
    # where SFT left any to remove (a rate above that noise); where SFT already abstains (docs/fields.md: seeds 1
    # and 2, and seed 0 on some CPUs, since the run's numbers vary), GRPO must not add confident answers beyond it.
    sampled, n = summary["blank_confident_rate_sampled"], summary["blank_samples"]
    assert n >= 4 * summary["held_out_pages"]
    sft, grpo = ((sampled[k] * n + 1) / (n + 2) for k in ("sft", "grpo"))
    noise = 2 * math.sqrt((sft * (1 - sft) + grpo * (1 - grpo)) / (n + 2))
    if sft > noise:
        assert grpo < sft - noise, summary
    else:
        assert grpo <= sft + noise, summary
    assert summary["grpo_blank_confident_rate"] and all(r is not None for r in summary["grpo_blank_confident_rate"])
    assert json.loads((out / "exported" / "qwenvl_policy.json").read_text())["max_pixels"] == STAGES[-1]
    assert len((out / "predictions-grpo.jsonl").read_text().splitlines()) == summary["held_out_pages"]
