"""Benchmark prompt presets (issue 43, item 4): each family's published prompt, asked of a converted benchmark's
own instructions by ``predict --prompt-preset``, its system prompt told the model frame, its answer read as the
source reads it, and the preset recorded with the predictions and in the report."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
from helpers import save_image, write_clip

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record
from qwenvl_prep.cli import main
from qwenvl_prep.formats.prompt_presets import (
    BENCHMARK_FORMATS, COMPUTER_USE_PREFILL, PRESETS, PresetError, computer_use_click, event_time_pairs, preset_for,
)
from qwenvl_prep.pipeline.predict import FolderModel

POLICY = ResizePolicy(16 * 28 * 28, 64 * 28 * 28)
FRAME = ["--min-pixels", str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels)]


def test_the_computer_use_system_prompt_is_the_sources_byte_for_byte():
    """ScreenSpot-Pro's Qwen2.5-VL system prompt (likaixin2000/ScreenSpot-Pro-GUI-Grounding models/qwen2_5vl.py at
    bd8bbbb, its two system texts joined, the resolution filled in as 1111x2222): pinned by digest, so that an edit
    of the long text cannot pass unnoticed."""
    text = preset_for("screenspot", "qwen2_5_vl").system_text(1111, 2222)
    assert len(text) == 3482
    assert hashlib.sha256(text.encode()).hexdigest() == \
        "b269779b4cc341a8e5b869dbb9acd6d82d44680b58f6efa14d06e6ca7545e1db"


def test_every_preset_names_its_source_and_places_the_instruction_once():
    assert {name for name, _ in PRESETS} == set(BENCHMARK_FORMATS)
    for preset in PRESETS.values():
        assert preset.template.count("{instruction}") == 1 and preset.source
        assert preset.target in ("point", "box", "span")
        # a system prompt or prefill only where the source has one, and then its answer is a tool call
        assert (preset.system is None and preset.prefill == "") == (preset.answer != "computer_use")
    with pytest.raises(PresetError, match="no Qwen3-VL ScreenSpot prompt is published.*qwen2_5_vl, qwen2_vl"):
        preset_for("screenspot", "qwen3_vl")
    with pytest.raises(PresetError, match="the presets are refcoco, screenspot"):
        preset_for("mmbench", "qwen2_5_vl")


@pytest.mark.parametrize("generated, click", [
    ("123, 456]}}\n</tool_call>", [123, 456]),
    ("10, 20, 30, 60]}}\n</tool_call>", [20.0, 40.0]),  # a box: its centre, as ScreenSpot-Pro's code scores it
    ("7.5, 8]}}", [7.5, 8]),  # no closing tag: read up to the last brace, as the source does
    ("1, 2]}, \"arguments\": {\"coordinate\": [3, 4]}}\n</tool_call>", None),  # a repeated key: ambiguous
    ("1, 2, 3]}}\n</tool_call>", None),
    ("true, 2]}}\n</tool_call>", None),
    ("NaN, 2]}}\n</tool_call>", None),
    ("the button]}}", None),
    ("1e308, 1, 1e308, 1]}}", [1e308, 1.0]),  # the centre of huge numbers stays finite
    ("1e309, 1]}}", None),  # infinity is no click
])
def test_a_computer_use_answer_is_its_click(generated, click):
    preset = preset_for("screenspot", "qwen2_5_vl")
    raw, read, unread = preset.read_answer(generated)
    assert raw == COMPUTER_USE_PREFILL + generated
    assert computer_use_click(raw) == click
    if click is None:
        assert read == raw and "no computer_use call" in unread
    else:
        assert json.loads(read) == [{"point_2d": click}] and unread is None
    assert computer_use_click("no tool call here") is None


def _folder(source, tmp_path, name="model"):
    model = tmp_path / name
    shutil.copytree(source, model)
    write_policy_record(model, POLICY)
    return model


def test_qwen2_vl_box_tokens_survive_decoding(tiny_model_qwen2, tmp_path):
    """Qwen2-VL answers with its grounding tokens, which its tokenizer marks special: a decode that skips special
    tokens turned ``<|box_start|>(1,2),(3,4)<|box_end|>`` into ``(1,2),(3,4)``, which no reader places."""
    model = FolderModel(_folder(tiny_model_qwen2, tmp_path))
    tokenizer = model.processor.tokenizer
    answer = "<|object_ref_start|>the dog<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>"
    ids = tokenizer(answer + "<|im_end|>")["input_ids"] + [tokenizer.pad_token_id] * 2
    assert model.decode([ids]) == [answer]
    assert "<|box_start|>" not in tokenizer.decode(ids, skip_special_tokens=True)  # what predict did before


def test_the_computer_use_system_prompt_is_told_the_model_frame(tiny_model, tiny_model_qwen3, tmp_path):
    model = FolderModel(_folder(tiny_model, tmp_path), preset=preset_for("screenspot", "qwen2_5_vl"))
    text = model.prompt_text("open the settings", (644, 476))
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n\n# Tools\n\n")
    assert "The screen's resolution is 476x644." in text and text.count("<|im_start|>system") == 1
    assert text.endswith("open the settings<|im_end|>\n<|im_start|>assistant\n" + COMPUTER_USE_PREFILL)
    with pytest.raises(ValueError, match="the prompt preset is qwen2_5_vl's; .* is a qwen3_vl model"):
        FolderModel(_folder(tiny_model_qwen3, tmp_path, "qwen3"), preset=preset_for("screenspot", "qwen2_5_vl"))


def test_answers_under_a_preset_map_to_original_pixels(tiny_model, tiny_model_qwen2, tmp_path):
    """A computer_use click (model-input pixels) and a Qwen2-VL box (box tokens, 0-1000) become items in the
    original image's pixels, as eval reads them."""
    model = FolderModel(_folder(tiny_model, tmp_path), preset=preset_for("screenspot", "qwen2_5_vl"))
    row = model._row("s.png", "open it", '100, 50]}}\n</tool_call>', (800, 1200), (400, 600))
    assert json.loads(row["predict"]) == [{"point_2d": [100, 50]}] and row["parse_error"] is None
    assert row["raw_answer"].startswith(COMPUTER_USE_PREFILL) and row["items"][0]["orig"] == [200.0, 100.0]
    qwen2 = FolderModel(_folder(tiny_model_qwen2, tmp_path, "qwen2"), preset=preset_for("screenspot", "qwen2_vl"))
    row = qwen2._row("s.png", "open it", "<|box_start|>(100,200),(300,400)<|box_end|>", (800, 1200), (392, 588))
    assert row["items"][0]["orig"] == [120.0, 160.0, 360.0, 320.0] and "raw_answer" not in row


@pytest.fixture(scope="module")
def screenspot(tmp_path_factory):
    """A converted ScreenSpot file of mixed-size screenshots, and a COCO-style dataset without instructions."""
    root = tmp_path_factory.mktemp("screenspot")
    sizes = [(640, 400), (300, 620), (900, 500)]
    for k, (w, h) in enumerate(sizes):
        save_image(root / f"s{k}.png", w, h, (40 * k, 120, 200))
    entries = [{"img_filename": f"s{k}.png", "bbox": [20, 30, 60, 40], "instruction": f"open menu {k}",
                "data_type": "icon", "data_source": "web"} for k in range(len(sizes))]
    (root / "ss.json").write_text(json.dumps(entries))
    data = root / "data" / "ss.jsonl"
    assert main(["convert", str(root / "ss.json"), "-o", str(data), *FRAME, "--workers", "1", "-q"]) == 0
    plain = root / "data" / "plain.jsonl"
    (root / "plain_in.jsonl").write_text(json.dumps({"image": "s0.png", "question": "Where is it?",
                                                     "answer": '[{"bbox_2d": [1, 2, 30, 40]}]'}) + "\n")
    assert main(["convert", str(root / "plain_in.jsonl"), "-o", str(plain), *FRAME, "--input-coords", "abs",
                 "--workers", "1", "-q"]) == 0
    return data, plain, entries


def test_predict_asks_the_records_in_the_presets_words(screenspot, tiny_model, tiny_model_qwen3, tmp_path, capsys):
    """One predict run under the Qwen2.5-VL ScreenSpot preset: each row asked the record's own instruction with the
    computer_use system prompt, its raw answer kept beside what eval reads; the preset, source and system prompt
    recorded with the predictions and named in the report; and the refusals."""
    data, plain, entries = screenspot
    model = _folder(tiny_model, tmp_path)
    preds = tmp_path / "preds.jsonl"
    assert main(["predict", str(model), "--dataset", str(data), "--prompt-preset", "screenspot", "-o", str(preds),
                 "--max-new-tokens", "6", "--batch-size", "2"]) == 0
    rows = [json.loads(line) for line in preds.read_text().splitlines()]
    assert [row["prompt"] for row in rows] == [entry["instruction"] for entry in entries]
    for row in rows:
        assert row["raw_answer"].startswith(COMPUTER_USE_PREFILL)
        # random weights write no click: the row says so, and eval scores it as no click
        assert row["parse_error"] == "the answer holds no computer_use call with a 2- or 4-number coordinate"
        assert row["model_size"] == list(reversed(POLICY.model_size(row["orig_size"][1], row["orig_size"][0])))
    settings = json.loads(preds.with_name(preds.name + ".settings.json").read_text())
    assert settings["prompt"] == preset_for("screenspot", "qwen2_5_vl").record()
    report = tmp_path / "report.md"
    assert main(["eval", str(data), "--predictions", str(preds), "--report", str(report), "--bootstrap", "50"]) == 0
    text = report.read_text()
    assert "preset `screenspot` for `qwen2_5_vl` (`ScreenSpot-Pro's own evaluation code" in text  # recorded values: code
    assert re.search(r"system prompt of \d{4} characters \(sha256 [0-9a-f]{16}\)", text)
    capsys.readouterr()

    other_frame = _folder(tiny_model, tmp_path, "other")
    write_policy_record(other_frame, ResizePolicy(8 * 28 * 28, 64 * 28 * 28))
    refused = [
        ([str(model), "--dataset", str(plain), "--prompt-preset", "screenspot"],
         "record 0 of .*plain.jsonl is not a screenspot / screenspot-pro record"),
        ([str(model), "--dataset", str(data), "--prompt-preset", "refcoco"],
         "record 0 of .*ss.jsonl is not a refcoco-parquet record"),
        ([str(_folder(tiny_model_qwen3, tmp_path, "qwen3")), "--dataset", str(data), "--prompt-preset", "screenspot"],
         "no Qwen3-VL ScreenSpot prompt is published"),
        ([str(model), str(data.parent / "s0.png"), "--prompt-preset", "screenspot"], "give --dataset"),
        # eval reads answers in the dataset's frame: a folder answering in another is refused before it loads
        ([str(_folder(tiny_model_qwen3, tmp_path, "qwen3b")), "--dataset", str(data)],
         r"converted for qwen2_5_vl \(model coordinates\); .* is a qwen3_vl model answering in rel1000"),
        ([str(other_frame), "--dataset", str(data)], "converted in the frame 12544..50176 pixels"),
    ]
    for args, why in refused:
        out = tmp_path / "refused.jsonl"
        assert main(["predict", *args, "-o", str(out)]) != 0
        assert re.search(why, capsys.readouterr().err) and not out.exists()


def test_the_timelens_prompt_is_the_sources_and_cleans_the_query_as_its_loader_does():
    """TencentARC/TimeLens evaluation/utils.py (df35740, lines 8-11) GROUNDER_PROMPT with the query in its '{}', the
    query cleaned as timelens_data.py parse_query does (whitespace collapsed, trailing periods dropped)."""
    for family in ("qwen2_5_vl", "qwen3_vl"):
        assert preset_for("timelens", family).user_text("  person  turn a\nlight on.. ") == (
            "Please find the visual event described by the sentence 'person turn a light on', determining its "
            "starting and ending times. The format should be: 'The event happens in <start time> - <end time> "
            "seconds'.")
    for family in ("qwen2_vl", "qwen3_5"):
        with pytest.raises(PresetError, match="TimeLens measured Qwen2.5-VL-7B-Instruct and Qwen3-VL-8B-Instruct"):
            preset_for("timelens", family)


@pytest.mark.parametrize("generated, pairs", [
    ("The event happens in 64.0 - 72.0 seconds.", [(64.0, 72.0)]),
    ("The event happens in 3 - 5 seconds, 8 - 9 seconds.", [(3.0, 5.0), (8.0, 9.0)]),
    ("From 00:23.5 to 01:02.", [(23.5, 62.0)]),  # clock times first, as extract_time reads them
    ("It starts at 1:00:02 and ends at 1:00:10.5", [(3602.0, 3610.5)]),
    ("It happens from 12 to 18.5 seconds", [(12.0, 18.5)]),
    ("Starting time: 0.8 seconds. Ending time: 1.1 seconds", [(0.8, 1.1)]),  # any numbers, paired in order
    ("The event happens in 9 - 4 seconds.", [(9.0, 4.0)]),  # inverted: kept, scored 0
    ("I cannot tell.", []),
    ("at 7 seconds", []),
])
def test_a_timelens_answer_is_its_first_time_pair(generated, pairs):
    assert event_time_pairs(generated) == pairs
    raw, read, unread = preset_for("timelens", "qwen3_vl").read_answer(generated)
    assert raw == generated
    if pairs:
        assert json.loads(read) == {"span": list(pairs[0])} and unread is None
    else:
        assert read == raw and unread == "the answer holds no pair of times"


def test_predict_asks_video_records_in_timelens_words(tiny_model, tmp_path, capsys):
    """``predict --prompt-preset timelens`` on a converted Charades-STA file: each clip asked its own query in
    TimeLens' words, the answer read as a span for eval; refused on images, on records of other formats, and by
    convert (its answers are words, convert's labels span JSON)."""
    root = tmp_path / "charades"
    root.mkdir()
    write_clip(root / "3MSZA.mp4", 2, 10, 96, 64)
    (root / "charades_sta_test.txt").write_text("3MSZA 0.0 1.5##person turn a light on.\n3MSZA 1 2##  person sits.\n")
    data = tmp_path / "data" / "charades.jsonl"
    assert main(["convert", str(root / "charades_sta_test.txt"), "-o", str(data), *FRAME, "--workers", "1",
                 "-q"]) == 0
    capsys.readouterr()
    model = _folder(tiny_model, tmp_path)
    preds = tmp_path / "preds.jsonl"
    assert main(["predict", str(model), "--dataset", str(data), "--prompt-preset", "timelens", "-o", str(preds),
                 "--max-new-tokens", "4"]) == 0
    rows = [json.loads(line) for line in preds.read_text().splitlines()]
    preset = preset_for("timelens", "qwen2_5_vl")
    assert [row["prompt"] for row in rows] == [preset.user_text("person turn a light on"),
                                               preset.user_text("person sits")]
    for row in rows:  # random weights: either a pair of numbers read as a span, or no pair, said so
        assert row["video"].endswith("3MSZA.mp4") and row["frames"] > 0
        if row["parse_error"] is None:
            assert list(json.loads(row["predict"])) == ["span"] and "raw_answer" in row
        else:
            assert row["parse_error"] == "the answer holds no pair of times" and "raw_answer" not in row
    settings = json.loads(preds.with_name(preds.name + ".settings.json").read_text())
    assert settings["prompt"] == preset.record() and settings["prompt"]["clean_query"] is True
    assert main(["eval", str(data), "--predictions", str(preds)]) == 0
    capsys.readouterr()
    refused = [
        (["predict", str(model), "--dataset", str(data), "--prompt-preset", "screenspot"],
         "record 0 of .*charades.jsonl is not a screenspot / screenspot-pro record"),
        (["convert", str(root / "charades_sta_test.txt"), "-o", str(tmp_path / "data" / "tl.jsonl"), *FRAME,
          "--prompt-preset", "timelens"], "the timelens preset for qwen2_5_vl is answered with 'The event happens"),
    ]
    for args, why in refused:
        assert main(args) != 0
        assert re.search(why, capsys.readouterr().err)
