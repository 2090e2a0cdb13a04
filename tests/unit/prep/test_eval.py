"""``qwenvl-prep eval``: known IoUs in the original frame, alignment checks."""

from __future__ import annotations

import json

import pytest
from helpers import save_image
from hypothesis import given, settings
from hypothesis import strategies as st

from llamafactory_qwenvl_patch.scoring.metrics import iou, match_boxes
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from qwenvl_prep.cli import main

MIN, MAX = 512 * 28 * 28, 1024 * 28 * 28


@pytest.fixture()
def dataset(tmp_path):
    save_image(tmp_path / "raw" / "wide.jpg", 2000, 1000)
    save_image(tmp_path / "raw" / "phone.jpg", 4032, 3024)
    lines = [{"image": "wide.jpg", "question": "Where?", "answer": '[{"bbox_2d": [0, 0, 1000, 500]}]'},
             {"image": "phone.jpg", "question": "Where?", "answer": '[{"bbox_2d": [0, 0, 2016, 1512]}]'}]
    (tmp_path / "raw" / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "data" / "test.json"
    assert main(["convert", str(tmp_path / "raw" / "in.jsonl"), "-o", str(out), "--input-coords", "abs",
                 "--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]) == 0
    return out


def answer(path, index):
    return json.loads(path.read_text())[index]["messages"][1]["content"]


def test_known_ious_and_buckets(dataset, tmp_path, capsys):
    policy = ResizePolicy(MIN, MAX)
    h, w = policy.model_size(1000, 2000)
    # Record 0: predicted box is the left half of the truth (IoU 0.5, centre 250 px off in original pixels).
    half = [0, 0, round(500 * w / 2000), round(500 * h / 1000)]
    rows = [{"prompt": "p", "predict": json.dumps([{"bbox_2d": half}]), "label": answer(dataset, 0)},
            {"prompt": "p", "predict": "I cannot see it", "label": answer(dataset, 1)}]
    preds = tmp_path / "generated_predictions.jsonl"
    preds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["eval", str(dataset), "--predictions", str(preds), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    overall = result["overall"]
    assert overall["mean_iou"] == pytest.approx(0.25, abs=0.01)
    assert overall["acc@0.5"] == pytest.approx(0.5, abs=1e-9)
    assert overall["parse_failure_rate"] == 0.5
    assert overall["mean_centre_offset_orig_px"] == pytest.approx(250, abs=2)
    assert set(result["by_size"]) == {"2-8 MP", ">=8 MP"}
    assert main(["eval", str(dataset), "--predictions", str(preds), "--plot", str(tmp_path / "p.png")]) == 0
    table = capsys.readouterr().out
    assert "IoU >= 0.5" in table and "overall" in table and (tmp_path / "p.png").stat().st_size > 0


def test_not_present_records_are_scored_apart_from_boxes(tmp_path, capsys):
    """Records whose answer is ``[]`` (convert --coco-absent) count how often the model said nothing and how often
    it answered with boxes; they do not enter Acc@0.5 or the field metrics."""
    save_image(tmp_path / "a.jpg", 640, 480)
    lines = [{"image": "a.jpg", "question": "Where is the dog?", "answer": "[]"}] * 3 + [
        {"image": "a.jpg", "question": "Where is the cat?", "answer": '[{"bbox_2d": [0, 0, 320, 240]}]'}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = tmp_path / "data" / "test.json"
    assert main(["convert", str(tmp_path / "in.jsonl"), "-o", str(data), "--input-coords", "abs", "--min-pixels",
                 str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]) == 0
    predictions = ["```json\n[]\n```", '[{"bbox_2d": [1, 1, 50, 50]}]', '[{"bbox_2d": "x"}]', answer(data, 3)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"predict": p}) + "\n" for p in predictions))
    capsys.readouterr()
    assert main(["eval", str(data), "--predictions", str(tmp_path / "p.jsonl"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["not_present"] == {"samples": 3, "said_nothing_rate": pytest.approx(1 / 3, abs=1e-4),
                                     "false_positive_rate": pytest.approx(1 / 3, abs=1e-4),
                                     "parse_failure_rate": pytest.approx(1 / 3, abs=1e-4)}
    assert result["overall"]["samples"] == 1 and result["overall"]["acc@0.5"] == 1.0 and "fields" not in result
    assert main(["eval", str(data), "--predictions", str(tmp_path / "p.jsonl")]) == 0
    assert "not present (answer []): 3 records" in capsys.readouterr().out


def test_misaligned_predictions_are_an_error(dataset, tmp_path, capsys):
    rows = [{"prompt": "p", "predict": "x", "label": answer(dataset, 1)},
            {"prompt": "p", "predict": "x", "label": answer(dataset, 0)}]
    preds = tmp_path / "generated_predictions.jsonl"
    preds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", str(dataset), "--predictions", str(preds)]) == 2
    assert "predictions row 0" in capsys.readouterr().err
    preds.write_text(json.dumps(rows[1]) + "\n")
    assert main(["eval", str(dataset), "--predictions", str(preds)]) == 2
    assert "different numbers of records (one ends at 1)" in capsys.readouterr().err
    preds.write_text(json.dumps(rows[1]) + "\n" + "{not json\n")
    assert main(["eval", str(dataset), "--predictions", str(preds)]) == 2
    assert "line 2 is not valid JSON" in capsys.readouterr().err


boxes = st.tuples(st.floats(0, 500), st.floats(0, 500), st.floats(1, 300), st.floats(1, 300)).map(
    lambda b: (b[0], b[1], b[0] + b[2], b[1] + b[3]))


@settings(deadline=None)
@given(st.lists(boxes, min_size=1, max_size=5), st.randoms())
def test_matching_is_order_independent(truth, rnd):
    predicted = [(x1 + 3, y1 - 2, x2 + 1, y2) for x1, y1, x2, y2 in truth]
    shuffled = list(predicted)
    rnd.shuffle(shuffled)
    total = sum(score for _, _, score in match_boxes(truth, predicted))
    assert sum(score for _, _, score in match_boxes(truth, shuffled)) == pytest.approx(total)
    pairs = match_boxes(truth, shuffled)
    assert len({t for t, _, _ in pairs}) == len({p for _, p, _ in pairs}) == len(pairs)  # one-to-one
    assert total >= sum(iou(t, p) for t, p in zip(truth, predicted)) - 1e-9  # no worse than the true pairing


@pytest.mark.slow
def test_real_lf_generated_predictions_join(dataset, tiny_model, tmp_path, capsys):
    """LF's own do_predict output (labels decoded by LF) lines up with the converted dataset, record by record."""
    from helpers import run_cli, train_config

    config = train_config(tiny_model, dataset.parent, tmp_path / "pred", do_train=None, do_predict=True,
                          predict_with_generate=True, dataset=None, eval_dataset="test", image_min_pixels=MIN,
                          image_max_pixels=MAX, max_new_tokens=8, per_device_eval_batch_size=2, finetuning_type=None,
                          lora_target=None)
    result = run_cli(["llamafactory-cli", "train"], config, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    preds = tmp_path / "pred" / "generated_predictions.jsonl"
    capsys.readouterr()
    assert main(["eval", str(dataset), "--predictions", str(preds), "--json"]) == 0
    overall = json.loads(capsys.readouterr().out)["overall"]
    assert overall["samples"] == 2 and overall["truth_boxes"] == 2


def test_field_metrics_next_to_grounding(tmp_path, capsys):
    save_image(tmp_path / "raw" / "invoice.png", 600, 800)
    save_image(tmp_path / "raw" / "wide.jpg", 2000, 1000)
    invoice = {"invoice_number": "INV-7", "date": "2024-06-18", "amount": "300.00"}
    lines = [{"image_path": "invoice.png", "question": "Fields?", "answer": invoice},
             {"image_path": "invoice.png", "question": "Fields?", "answer": {**invoice, "invoice_number": "INV-8"}},
             {"image_path": "invoice.png", "question": "Fields?", "answer": invoice},
             {"image": "wide.jpg", "question": "Where?", "answer": '[{"bbox_2d": [0, 0, 1000, 500]}]'},
             {"image": "wide.jpg", "question": "Colour?", "answer": "blue"}]
    (tmp_path / "raw" / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = tmp_path / "data" / "mixed.json"
    assert main(["convert", str(tmp_path / "raw" / "in.jsonl"), "-o", str(data), "--input-coords", "abs",
                 "--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]) == 0
    predictions = ['{"invoice_number": "inv-7", "date": "2024/06/18", "amount": 300}',  # all right, by value
                   'Here you go: {"invoice_number": "INV-8", "date": "2024-06-19"}',  # 1 of 3 right, not JSON only
                   "no idea",
                   answer(data, 3), "blue"]
    preds = tmp_path / "generated_predictions.jsonl"
    preds.write_text("".join(json.dumps({"predict": p, "label": answer(data, i)}) + "\n"
                             for i, p in enumerate(predictions)))
    capsys.readouterr()
    assert main(["eval", str(data), "--predictions", str(preds), "--json", "--plot", str(tmp_path / "p.png")]) == 0
    result = json.loads(capsys.readouterr().out)
    fields = result["fields"]
    assert fields["samples"] == 3 and result["skipped_other"] == 1 and result["overall"]["acc@0.5"] == 1.0
    assert fields["per_field_accuracy"] == {"invoice_number": 0.6667, "date": 0.3333, "amount": 0.3333}
    assert fields["all_fields_exact"] == pytest.approx(1 / 3, abs=1e-4)
    assert fields["format_valid_rate"] == pytest.approx(1 / 3, abs=1e-4)
    assert fields["parse_failure_rate"] == pytest.approx(1 / 3, abs=1e-4)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert main(["eval", str(data), "--predictions", str(preds)]) == 0
    assert "invoice_number" in capsys.readouterr().out


def test_a_number_too_long_for_python_is_a_parse_failure_or_an_error_row(dataset, tmp_path, capsys):
    """A 5,000-digit coordinate (Python will not make an int of it) used to abort eval and convert with
    'Exceeds the limit (4300 digits)' and no record named: in a prediction it is now that answer's parse failure,
    in a label an error row naming the record."""
    huge = "9" * 5000
    rows = [{"prompt": "p", "predict": f'[{{"bbox_2d": [0, 0, {huge}, 10]}}]', "label": answer(dataset, 0)},
            {"prompt": "p", "predict": answer(dataset, 1), "label": answer(dataset, 1)}]
    preds = tmp_path / "generated_predictions.jsonl"
    preds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["eval", str(dataset), "--predictions", str(preds), "--json"]) == 0
    overall = json.loads(capsys.readouterr().out)["overall"]
    assert overall["parse_failure_rate"] == 0.5 and overall["acc@0.5"] == 0.5
    raw = tmp_path / "raw" / "huge.jsonl"
    raw.write_text(json.dumps({"image": "wide.jpg", "question": "Where?", "answer": "[]"}).replace(
        '"[]"', '"[{\\"bbox_2d\\": [0, 0, ' + huge + ', 10]}]"') + "\n" + json.dumps(
        {"image": "wide.jpg", "question": "Where?", "answer": '[{"bbox_2d": [0, 0, 100, 50]}]'}) + "\n")
    out = tmp_path / "data" / "huge.json"
    code = main(["convert", str(raw), "-o", str(out), "--input-coords", "abs", "--min-pixels", str(MIN),
                 "--max-pixels", str(MAX), "-q", "--workers", "1"])
    assert code == 1 and not out.exists()
    [row] = [json.loads(line) for line in out.with_name(out.name + ".errors.jsonl").read_text().splitlines()]
    assert row["record"] == 0 and "5000 characters" in row["error"], row


def test_an_answer_of_100000_boxes_is_a_named_parse_failure(dataset, tmp_path, capsys):
    """Issue 51, class 5: one answer of 100,000 boxes (a 3.6-MB row) had no result after 10 minutes; eval, --report and
    --compare now score it as a parse failure and name its row."""
    hostile = json.dumps([{"bbox_2d": [k % 900, 10, 950, 960]} for k in range(100_000)])
    rows = [{"predict": answer(dataset, 0), "label": answer(dataset, 0)},
            {"predict": hostile, "label": answer(dataset, 1)}]
    preds = tmp_path / "hostile.jsonl"
    preds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["eval", str(dataset), "--predictions", str(preds), "--compare", str(preds), "--report",
                 str(tmp_path / "r.md"), "--bootstrap", "10", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    overall = json.loads(captured.out)["overall"]
    assert overall["parse_failure_rate"] == 0.5 and overall["acc@0.5"] == 0.5
    assert "1 answer(s) longer than a model writes, scored as parse failures (rows 1)" in captured.err
    assert "the answer has 100000 boxes, points or spans" in captured.err
