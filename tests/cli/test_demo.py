"""``qwenvl-prep demo``: the smoke runs of every task (and of the families the learning runs leave out) and the
demos' own parts; the default grounding demo runs end to end, its export reloaded, in test_demo_learns.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from demo_checks import check_grounding_summary
from helpers import run_cli
from PIL import Image

from qwenvl_prep.demos.fields import (FIELDS, PAGE_SIZES, blank_copies, confident_rate, most_common_answer,
                                      render_invoice, synthesise_invoices)


@pytest.mark.slow
def test_qwen3_5_demo_runs_end_to_end(tmp_path):
    """Qwen3.5 (Gated DeltaNet and full-attention layers) through the same steps, the frame taken from the
    checkpoint (factor 32, labels in 0-1000, predictions mapped back to original pixels), GRPO with the exact shared
    prefix on; another --seed draws other photos (named by their seed) and another initial model. (Qwen3-VL, the
    same factor and convention, runs the demo pipeline in the video and agent demos' smoke runs; Qwen2-VL in the GUI
    demo's.)"""
    out = tmp_path / "q35"
    result = run_cli(["qwenvl-prep", "demo", str(out), "--steps", "6", "--family", "qwen3_5", "--seed", "1"], None,
                     tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    check_grounding_summary(out, summary, "qwen3_5", 32, "rel1000", 6)
    assert summary["seed"] == 1 and json.loads((out / "model" / "tiny_model.json").read_text())["seed"] == 1
    assert {path.name[:3] for path in (out / "raw").glob("*.jpg")} == {"s2_", "s3_"}
    raw = json.loads((out / "raw" / "eval.jsonl").read_text().splitlines()[0])
    x1, y1, x2, y2 = json.loads(raw["answer"])[0]["bbox_2d"]
    w, h = Image.open(out / "raw" / raw["image"]).size
    label = json.loads(json.loads((out / "data" / "demo_eval.json").read_text())[0]["messages"][1]["content"])
    assert label[0]["bbox_2d"] == [round(x1 / w * 1000), round(y1 / h * 1000), round(x2 / w * 1000),
                                   round(y2 / h * 1000)]
    assert "grpo_shared_prefix: on" in (out / "logs" / "train-grpo.log").read_text()
    assert json.loads((out / "data" / "dataset_info.json").read_text())["demo_train"]["qwenvl_policy"][
        "family"] == "qwen3_5"


def test_fields_demo_pages_baseline_and_blank_rate(tmp_path):
    """The fields demo's own parts: pages rendered the same for a seed, in the recipe's JSONL shape; the baseline is
    each field's most common training value; blank copies keep each page's size; the confident rate counts answers
    that commit to a field (an all-null answer or prose does not)."""
    records = synthesise_invoices(tmp_path / "a", 5, seed=3)
    again = synthesise_invoices(tmp_path / "b", 5, seed=3)
    assert records == again and all(list(r["answer"]) == list(FIELDS) for r in records)
    for record in records:
        assert (tmp_path / "a" / record["image_path"]).read_bytes() == (tmp_path / "b" / record["image_path"]).read_bytes()
        assert Image.open(tmp_path / "a" / record["image_path"]).size in PAGE_SIZES
        assert record["answer"]["invoice_number"] is None or record["answer"]["invoice_number"].isdigit()
    answers = [{"invoice_number": n, "document_type": "quote", "vendor": "Acme", "currency": c}
               for n, c in (("101", "EUR"), ("102", "USD"), ("102", "USD"), ("101", "GBP"))]
    assert most_common_answer([{"answer": a} for a in answers]) == {
        "invoice_number": "101", "document_type": "quote", "vendor": "Acme", "currency": "USD"}
    blanks = blank_copies(tmp_path / "blank", records[:2], tmp_path / "a")
    for record, blank in zip(records, blanks):
        image = Image.open(tmp_path / "blank" / blank["image_path"])
        assert image.size == Image.open(tmp_path / "a" / record["image_path"]).size and len(image.getcolors()) == 1
        assert blank["answer"] == record["answer"]
    rows = [{"predict": json.dumps(records[0]["answer"])}, {"predict": json.dumps(dict.fromkeys(FIELDS))},
            {"predict": "I cannot read this page."}, {"predict": '{"vendor": "Acme"}'}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert confident_rate(tmp_path / "p.jsonl", records[:4]) == 0.5


def test_a_field_left_off_the_invoice_is_null_and_not_drawn(tmp_path):
    """Invoices leave fields out (``OMIT_SHARE``): such a field is null in the answer and nothing on the page, and the
    baseline's most common value is a filled one."""
    import random

    records = synthesise_invoices(tmp_path, 40, seed=0)
    assert any(value is None for r in records for value in r["answer"].values())
    assert all(value is None or isinstance(value, str) for r in records for value in r["answer"].values())
    assert None not in most_common_answer([{"answer": dict.fromkeys(FIELDS)}] * 3 + records).values()
    render_invoice(tmp_path / "empty.png", PAGE_SIZES[0], dict.fromkeys(FIELDS), random.Random(0))
    assert len(Image.open(tmp_path / "empty.png").getcolors()) == 1  # the paper only
    full = {"invoice_number": "123", "document_type": "quote", "vendor": "Acme", "currency": "EUR"}
    for key in FIELDS:
        render_invoice(tmp_path / "full.png", PAGE_SIZES[0], full, random.Random(0))
        render_invoice(tmp_path / "less.png", PAGE_SIZES[0], {**full, key: None}, random.Random(0))
        assert Image.open(tmp_path / "full.png").tobytes() != Image.open(tmp_path / "less.png").tobytes()


def test_gui_screens_label_the_elements_they_draw(tmp_path):
    """The GUI demo's ScreenSpot boxes sit on the elements they name, at real screen sizes: inside each box, near
    its top-left corner (where neither the label text nor the icon's glyph is drawn), the pixels have the colour of
    the instruction's label; every platform appears; the file is ScreenSpot's layout (bbox as left, top, width,
    height). Screens with several controls (a harder variant than the demo's one) never overlap them."""
    import random

    import cv2

    from qwenvl_prep.demos.gui import LABELS, SCREENS, draw_screen, screenspot_entries, synthesise_screens, write_screenspot

    def on_element(image, box, label):
        x1, y1, x2, y2 = box
        probe = (y1 + max(2, (y2 - y1) // 20), x1 + max(2, (x2 - x1) // 20))
        return abs(image[probe].astype(int) - LABELS[label]).max() < 40

    entries = screenspot_entries(synthesise_screens(tmp_path, seed=3), 24, 1, seed=3)
    assert len(entries) == 24 and {entry["platform"] for entry, _ in entries} == set(SCREENS)
    for entry, shot in entries:
        image = cv2.imread(str(tmp_path / entry["img_filename"]))
        width, height = SCREENS[entry["platform"]]
        assert image.shape[:2] == (height, width) and shot.size == (width, height)
        x, y, w, h = entry["bbox"]
        assert 0 <= x and x + w <= width and 0 <= y and y + h <= height
        assert on_element(image, (x, y, x + w, y + h), entry["instruction"].removeprefix("click ")), entry
    written = json.loads(write_screenspot(tmp_path / "gui.json", entries).read_text())
    assert written == [entry for entry, _ in entries] and set(written[0]) == {
        "img_filename", "bbox", "instruction", "data_type", "data_source", "platform"}
    rng = random.Random(5)
    for size in SCREENS.values():
        image, elements = draw_screen(size, rng, 3)
        assert len(elements) == 3 and len({e.label for e in elements}) == len(elements)
        assert all(on_element(image, e.box, e.label) for e in elements)
        boxes = [e.box for e in elements]
        assert all(a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
                   for i, a in enumerate(boxes) for b in boxes[i + 1:])


@pytest.mark.parametrize("args, message", [
    (["--minutes", "nan"], "--minutes takes a number > 0"), (["--minutes", "0"], "--minutes takes a number > 0"),
    (["--steps", "0"], "must be at least 1"), (["--seed", "-1"], "must be at least 0"),
    (["--seed", str(2**32)], "a seed must be below 2**32"), (["--task", "fields", "--family", "qwen3_vl"],
                                                             "the fields demo uses Qwen2.5-VL"),
    (["--controls", "2"], "--controls applies to the gui demo"), (["--task", "fields", "--controls", "1"],
                                                                  "--controls applies to the gui demo"),
    (["--task", "agent", "--controls", "1"], "--controls applies to the gui demo"),
    (["--task", "agent", "--family", "qwen9"], "invalid choice"),
    (["--task", "gui", "--controls", "4"], "--controls must be 1 to 3"),
    (["--task", "gui", "--controls", "0"], "--controls must be 1 to 3"),
])
def test_demo_refuses_bad_arguments_before_doing_anything(tmp_path, capsys, args, message):
    """A mistaken demo argument is one line naming it, before any step runs, and the output folder is not made
    (otherwise a seed numpy refuses fails inside a training subprocess, and --minutes nan in a traceback)."""
    from qwenvl_prep.cli import main

    out = tmp_path / "run"
    try:
        code = main(["demo", str(out), *args])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err and not out.exists()


def test_other_control_rate_counts_clicks_on_controls_the_instruction_did_not_name():
    """Clicks on the named control, on the other one, on neither and none: only those on the other count, in both
    conventions (0-1000 and model pixels of a frame whose sides differ, so swapped sides would miss)."""
    from qwenvl_prep.demos.gui import Element, Shot, other_control_rate

    shot = Shot("s.jpg", "desktop", (1920, 1080), (Element("Save", "text", (0, 0, 100, 50)),
                                                   Element("Home", "icon", (1800, 900, 1900, 1000))))
    entry = {"instruction": "click Save", "bbox": [0, 0, 100, 50]}
    rel = {"orig_size": [1920, 1080], "model_size": [288, 160], "coords": "rel1000"}
    model = {"orig_size": [1920, 1080], "model_size": [280, 168], "coords": "model"}
    rows = [{"predict": answer, **rel} for answer in (
        '[{"point_2d": [26, 23]}]', '[{"point_2d": [963, 880]}]', '[{"bbox_2d": [950, 850, 980, 900]}]',
        '[{"point_2d": [500, 500]}]', "no click")]  # on Save; on Home; a box centred on Home; neither; none
    rows += [{"predict": answer, **model} for answer in (
        '[{"point_2d": [270, 147]}]', '[{"point_2d": [7, 4]}]', '[{"point_2d": [147, 270]}]')]  # Home; Save; off
    assert other_control_rate([(entry, shot)] * 8, rows) == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="4 predictions for 5 held-out instructions"):
        other_control_rate([(entry, shot)] * 5, rows[:4])


@pytest.mark.slow
def test_gui_demo_smoke_run_with_two_controls(tmp_path):
    """The GUI demo's smoke path (under 50 steps) with two controls a screen, on Qwen2-VL: every step runs through
    llamafactory-cli, each screenshot holds two controls, and each model's clicks on the control the instruction did
    not name are reported beside its accuracy. Qwen2-VL has factor 28 like Qwen2.5-VL but answers in 0-1000 like
    Qwen3-VL, the one family whose factor and convention pair differently, so a step that guessed one from the other
    would show here."""
    out = tmp_path / "gui"
    result = run_cli(["qwenvl-prep", "demo", str(out), "--task", "gui", "--steps", "6", "--controls", "2",
                      "--family", "qwen2_vl"], None, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    assert summary["controls"] == 2 and summary["sft_steps"] == 6 and summary["family"] == "qwen2_vl"
    rows = [json.loads(line) for line in (out / "predictions-grpo.jsonl").read_text().splitlines()]
    assert len(rows) == summary["held_out_instructions"]
    assert all(row["model_size"][0] % 28 == 0 and row["model_size"][1] % 28 == 0 and row["coords"] == "rel1000"
               for row in rows)
    assert json.loads((out / "exported" / "qwenvl_policy.json").read_text())["factor"] == 28
    assert "OK" in (out / "logs" / "check.log").read_text()
    assert set(summary["click"]) == {"baseline", "untrained", "sft", "grpo"}
    for result_of_model in summary["click"].values():
        overall = result_of_model["overall"]
        assert overall["samples"] == summary["held_out_instructions"]
        assert 0 <= overall["other_control_rate"] <= 1 - overall["click_acc"]
    assert "other control" in result.stderr and (out / "exported" / "qwenvl_policy.json").exists()
    import cv2

    from qwenvl_prep.demos.gui import LABELS

    image = cv2.imread(str(out / "raw" / json.loads((out / "raw" / "eval.json").read_text())[0]["img_filename"]))

    saturated = {label for label, colour in LABELS.items()
                 if (abs(image.astype(int) - colour).max(axis=2) < 30).sum() > 500}
    assert len(saturated) == 2


@pytest.mark.slow
def test_video_demo_smoke_run(tmp_path):
    """The video demo's smoke path (under 50 steps): clips written and converted as a video-span file into the run's
    video frame and clock, SFT and GRPO on video prompts through llamafactory-cli, an export that carries the video
    policy, predict on held-out clips and span metrics for the untrained, baseline and trained models."""
    out = tmp_path / "video"
    result = run_cli(["qwenvl-prep", "demo", str(out), "--task", "video", "--steps", "6"], None, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    assert summary["task"] == "video" and summary["sft_steps"] == 6 and summary["family"] == "qwen3_vl"
    assert set(summary["held_out"]) == {"baseline", "untrained", "trained"}
    assert all(0 <= m["mean_tiou"] <= 1 for m in summary["held_out"].values())
    assert summary["held_out"]["baseline"]["mean_tiou"] > 0
    record = json.loads((out / "exported" / "qwenvl_policy.json").read_text())
    assert {key: record["video"][key] for key in summary["video_policy"]} == summary["video_policy"]
    stamp = json.loads((out / "data" / "dataset_info.json").read_text())["demo_eval"]["qwenvl_policy"]
    assert {key: stamp["video"][key] for key in summary["video_policy"]} == summary["video_policy"]
    rows = [json.loads(line) for line in (out / "predictions-trained.jsonl").read_text().splitlines()]
    assert len(rows) == summary["held_out_clips"] and all(row["video"].endswith(".mp4") for row in rows)
    assert "R@1 tIoU 0.5" in result.stderr


@pytest.mark.slow
def test_agent_demo_smoke_run(tmp_path):
    """The agent demo's smoke path (under 50 steps): single screens converted into the model's frame, SFT and
    multi-turn GRPO against the shipped simulator through llamafactory-cli, an export with the pinned policy, and
    agent-eval of the held-out tasks by the untrained, SFT and trained models; every turn's screenshot is a real
    screen size shown in the run's frame."""
    from llamafactory_qwenvl_patch.frame.families import FAMILIES
    from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
    from qwenvl_prep.demos import gui
    from qwenvl_prep.demos.agent import HELD_OUT_SMOKE, MAX_TURNS

    out = tmp_path / "agent"
    result = run_cli(["qwenvl-prep", "demo", str(out), "--task", "agent", "--steps", "6"], None, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    assert summary["task"] == "agent" and summary["sft_steps"] == 6 and summary["family"] == "qwen3_vl"
    assert set(summary["held_out"]) == {"untrained", "sft", "trained"} and "SFT + GRPO" in result.stderr
    policy = ResizePolicy(gui.MIN_PIXELS, gui.MAX_PIXELS, FAMILIES["qwen3_vl"].factor)
    for evaluated in summary["held_out"].values():
        assert evaluated["trajectories"] == HELD_OUT_SMOKE and 0 <= evaluated["success_rate"] <= 1
        rows = [json.loads(line) for line in Path(evaluated["rows"]).read_text().splitlines()]
        assert len(rows) == HELD_OUT_SMOKE and all(1 <= len(row["turns"]) <= MAX_TURNS for row in rows)
        for turn in (turn for row in rows for turn in row["turns"]):
            assert tuple(turn["orig_size"]) in set(gui.SCREENS.values())
            width, height = turn["orig_size"]
            assert tuple(turn["model_size"]) == policy.model_size(height, width)[::-1]
    trained = json.loads(Path(summary["held_out"]["trained"]["report"]).with_suffix(".json").read_text())
    assert trained["agent"]["success_rate"] == summary["held_out"]["trained"]["success_rate"]
    grpo_log = [json.loads(line) for line in (out / "grpo" / "trainer_log.jsonl").read_text().splitlines()]
    assert any("rewards/env/mean" in row and "agent/turns/mean" in row for row in grpo_log)
    assert json.loads((out / "exported" / "qwenvl_policy.json").read_text())["max_pixels"] == gui.MAX_PIXELS
    first = json.loads((out / "data" / "agent_train.json").read_text())[0]  # a trajectory: a screenshot a turn
    assert [m["content"].count("<image>") for m in first["messages"]] == [1, 0, 1, 0] and len(first["images"]) == 2
