"""``qwenvl-prep demo``, the main job, end to end; the export it makes reloads with the pinned frame."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli
from PIL import Image

from qwenvl_prep.demo import MAX_PIXELS, MIN_PIXELS


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    result = run_cli(["qwenvl-prep", "demo", str(out), "--steps", "6"], None, out.parent)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, json.loads(result.stdout)


def check_summary(out, summary, family: str, factor: int, coords: str) -> None:
    assert summary["family"] == family and summary["sft_steps"] == 6
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


@pytest.mark.slow
def test_demo_runs_end_to_end(demo):
    out, summary = demo
    check_summary(out, summary, "qwen2_5_vl", 28, "model")


@pytest.mark.slow
def test_qwen3_vl_demo_runs_end_to_end(tmp_path):
    """Qwen3-VL through the same steps: labels in 0-1000, factor 32, predictions mapped back to original pixels;
    another --seed draws other photos (named by their seed) and another initial model."""
    out = tmp_path / "q3"
    result = run_cli(["qwenvl-prep", "demo", str(out), "--steps", "6", "--family", "qwen3_vl", "--seed", "1"], None,
                     tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    check_summary(out, summary, "qwen3_vl", 32, "rel1000")
    assert summary["seed"] == 1 and json.loads((out / "model" / "tiny_model.json").read_text())["seed"] == 1
    assert {path.name[:3] for path in (out / "raw").glob("*.jpg")} == {"s2_", "s3_"}
    raw = json.loads((out / "raw" / "eval.jsonl").read_text().splitlines()[0])
    x1, y1, x2, y2 = json.loads(raw["answer"])[0]["bbox_2d"]
    w, h = Image.open(out / "raw" / raw["image"]).size
    label = json.loads(json.loads((out / "data" / "demo_eval.json").read_text())[0]["messages"][1]["content"])
    assert label[0]["bbox_2d"] == [round(x1 / w * 1000), round(y1 / h * 1000), round(x2 / w * 1000),
                                   round(y2 / h * 1000)]


@pytest.mark.slow
def test_export_reloads_with_the_pinned_bounds(demo):
    out, _ = demo
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(out / "exported")
    assert processor.image_processor.size["shortest_edge"] == MIN_PIXELS
    assert processor.image_processor.size["longest_edge"] == MAX_PIXELS
    AutoModelForImageTextToText.from_pretrained(out / "exported")
    preprocessor = json.loads((out / "exported" / "preprocessor_config.json").read_text())
    assert preprocessor["size"] == {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    record = json.loads((out / "exported" / "qwenvl_policy.json").read_text())
    assert (record["min_pixels"], record["max_pixels"], record["factor"]) == (MIN_PIXELS, MAX_PIXELS, 28)


@pytest.mark.slow
def test_fields_demo_runs_end_to_end(tmp_path):
    """The field-extraction demo: curriculum stages in their own frames, SFT resuming, GRPO with the blank-image
    control, export, predict and field metrics."""
    out = tmp_path / "fields"
    result = run_cli(["qwenvl-prep", "demo", str(out), "--task", "fields"], None, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    assert [s["image_max_pixels"] for s in summary["stages"]] == [64 * 28 * 28, 256 * 28 * 28]
    assert all(len(s["sft_loss"]) == 4 for s in summary["stages"])
    second = (out / "curriculum" / "stage2.yaml").read_text()
    assert str(out / "sft" / "stage1") in second  # stage 2 resumes stage 1's adapter
    assert summary["metrics"]["samples"] == 4 and set(summary["metrics"]["per_field_accuracy"]) == {
        "invoice_number", "date", "total"}
    assert len(summary["grpo_reward"]) == 2 and (out / "exported" / "qwenvl_policy.json").is_file()
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 4


def test_gui_screens_label_the_elements_they_draw(tmp_path):
    """The GUI demo's ScreenSpot boxes sit on the elements they name, at real screen sizes: inside each box, near
    its top-left corner (where neither the label text nor the icon's glyph is drawn), the pixels have the colour of
    the instruction's label; an image's elements never overlap; every platform appears; the file is ScreenSpot's
    layout (bbox as left, top, width, height)."""
    import cv2

    from qwenvl_prep.demo_gui import LABELS, SCREENS, screenspot_entries, synthesise_screens, write_screenspot

    entries = screenspot_entries(synthesise_screens(tmp_path, seed=3), 24, 2, seed=3)
    assert len(entries) == 24 and {entry["platform"] for entry, _ in entries} == set(SCREENS)
    for entry, shot in entries:
        image = cv2.imread(str(tmp_path / entry["img_filename"]))
        width, height = SCREENS[entry["platform"]]
        assert image.shape[:2] == (height, width) and shot.size == (width, height)
        x, y, w, h = entry["bbox"]
        assert 0 <= x and x + w <= width and 0 <= y and y + h <= height
        label = entry["instruction"].removeprefix("click ")
        probe = (y + max(2, h // 20), x + max(2, w // 20))
        assert abs(image[probe].astype(int) - LABELS[label]).max() < 40, (entry, image[probe])
        boxes = [e.box for e in shot.elements]
        assert all(a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
                   for i, a in enumerate(boxes) for b in boxes[i + 1:])
    written = json.loads(write_screenspot(tmp_path / "gui.json", entries).read_text())
    assert written == [entry for entry, _ in entries] and set(written[0]) == {
        "img_filename", "bbox", "instruction", "data_type", "data_source", "platform"}
