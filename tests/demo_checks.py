"""What every grounding demo run must show, whatever its step count: the learning run of the default demo and the
smoke runs of other families check the same things (one run per family, not a smoke run and a learning run)."""

from __future__ import annotations

import json
from pathlib import Path


def check_grounding_summary(out: Path, summary: dict, family: str, factor: int, coords: str, steps: int) -> None:
    """The demo's summary, its reports, predictions, export and drawings: every model scored on every held-out
    image, predictions in the family's frame and convention, the export pinned to that frame."""
    assert summary["family"] == family and summary["sft_steps"] == steps
    assert set(summary["held_out"]) == {"baseline", "untrained", "trained"}
    n = summary["held_out_images"]
    for name in ("baseline", "untrained", "trained"):
        assert json.loads((out / f"eval-{name}.json").read_text())["overall"]["samples"] == n
    assert summary["held_out"]["baseline"]["parse_failure_rate"] == 0.0
    assert summary["held_out"]["baseline"]["mean_iou"] > 0
    assert len(summary["grpo_reward_first_last"]) == 2 and (out / "grpo" / "model.safetensors").exists()
    rows = [json.loads(line) for line in (out / "predictions-trained.jsonl").read_text().splitlines()]
    assert len(rows) == n and all(row["model_size"][0] % factor == 0 and row["coords"] == coords for row in rows)
    assert json.loads((out / "exported" / "qwenvl_policy.json").read_text())["factor"] == factor
    assert (out / "drawn" / "demo_eval-contact-sheet-original.jpg").stat().st_size > 0
    assert "OK" in (out / "logs" / "check.log").read_text()


def check_export_reloads_with_the_pinned_bounds(out: Path, min_pixels: int, max_pixels: int) -> None:
    """The demo's export reloads with transformers' Auto classes, its processor bounded by the run's frame."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(out / "exported")
    assert processor.image_processor.size["shortest_edge"] == min_pixels
    assert processor.image_processor.size["longest_edge"] == max_pixels
    AutoModelForImageTextToText.from_pretrained(out / "exported")
    preprocessor = json.loads((out / "exported" / "preprocessor_config.json").read_text())
    assert preprocessor["size"] == {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    record = json.loads((out / "exported" / "qwenvl_policy.json").read_text())
    assert (record["min_pixels"], record["max_pixels"], record["factor"]) == (min_pixels, max_pixels, 28)
