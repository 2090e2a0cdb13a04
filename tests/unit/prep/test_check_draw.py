"""``qwenvl-prep check`` and ``draw`` on converted data."""

from __future__ import annotations

import json

import cv2
import pytest
from helpers import save_image

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from qwenvl_prep.lf.drift import stock_llamafactory_size
from qwenvl_prep.cli import main

MIN, MAX = 256 * 28 * 28, 1024 * 28 * 28


@pytest.fixture()
def dataset(tmp_path):
    raw = tmp_path / "raw"
    save_image(raw / "phone.jpg", 4032, 3024)
    save_image(raw / "coco.jpg", 640, 480)
    lines = [{"image": "phone.jpg", "question": "Where?", "answer": '[{"bbox_2d": [2000, 1500, 4032, 3024]}]'},
             {"image": "coco.jpg", "question": "Where?", "answer": '[{"bbox_2d": [10, 10, 100, 100], "label": "a"}]'}]
    (raw / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = tmp_path / "data"
    assert main(["convert", str(raw / "in.jsonl"), "-o", str(data / "grounding.json"), "--input-coords", "abs",
                 "--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]) == 0
    return data


def write_yaml(tmp_path, data, **extra):
    config = {"template": "qwen2_vl", "image_min_pixels": MIN, "image_max_pixels": MAX, "qwenvl_patch": True,
              "dataset": "grounding", "dataset_dir": str(data), "cutoff_len": 4096, **extra}
    path = tmp_path / "train.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in config.items()))
    return path


def check_json(capsys, *args) -> tuple[int, dict]:
    code = main(["check", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)[0]


def test_check_passes_and_audits_drift(tmp_path, dataset, capsys):
    code, report = check_json(capsys, "--yaml", write_yaml(tmp_path, dataset), "--decode", "--workers", "1")
    assert code == 0 and report["ok"] and report["samples"] == 2
    drift = report["drift"]
    policy = ResizePolicy(MIN, MAX)
    stock = stock_llamafactory_size(3024, 4032, MIN, MAX)
    assert drift["frames_changed"] == 1 and stock != policy.model_size(3024, 4032)
    assert drift["frame_max_px"] == max(abs(a - b) for a, b in zip(stock, policy.model_size(3024, 4032)))
    assert drift["label_max_model_px"] > 0 and drift["label_max_orig_px"] > drift["label_max_model_px"]


def test_check_finds_mismatch_tokens_and_outside_boxes(tmp_path, dataset, capsys):
    code, report = check_json(capsys, "--yaml", write_yaml(tmp_path, dataset, image_max_pixels=MAX * 2,
                                                           cutoff_len=300))
    assert code == 1
    assert report["stamp_problems"] == [f"max_pixels: dataset {MAX} vs run {MAX * 2}"]
    assert report["token_overflows"] == 2
    records = json.loads((dataset / "grounding.json").read_text())
    records[1]["messages"][1]["content"] = '[{"bbox_2d": [10, 10, 5000, 100]}]'
    (dataset / "grounding.json").write_text(json.dumps(records))
    code, report = check_json(capsys, "--yaml", write_yaml(tmp_path, dataset))
    assert code == 1 and "outside the model frame" in report["problems"][0]["error"]
    (dataset / "grounding.json").write_text(json.dumps(records[:1]))
    (tmp_path / "raw" / "phone.jpg").write_bytes((tmp_path / "raw" / "phone.jpg").read_bytes()[:2000])
    code, report = check_json(capsys, "--yaml", write_yaml(tmp_path, dataset), "--decode", "--workers", "1")
    assert code == 1 and "truncated" in report["problems"][0]["error"]


def test_check_reads_a_trajectorys_clicks_in_each_turns_screenshot(tmp_path, capsys):
    """A converted trajectory (a screenshot a user turn, a click in each answer) passes check; a click moved
    outside its own screenshot's frame, though inside the first one's, is a problem naming that screenshot."""
    raw = tmp_path / "raw"
    save_image(raw / "wide.jpg", 4032, 3024)
    save_image(raw / "tall.jpg", 600, 1800)
    record = {"messages": [{"role": "user", "content": "Go.<image>Screen 1"},
                           {"role": "assistant", "content": '{"action": "click", "point_2d": [3000, 2000]}'},
                           {"role": "user", "content": "<image>Screen 2"},
                           {"role": "assistant", "content": '{"action": "click", "point_2d": [300, 1700]}'}],
              "images": ["wide.jpg", "tall.jpg"]}
    (raw / "in.jsonl").write_text(json.dumps(record) + "\n")
    data = tmp_path / "data"
    assert main(["convert", str(raw / "in.jsonl"), "-o", str(data / "grounding.json"), "--input-coords", "abs",
                 "--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]) == 0
    capsys.readouterr()
    code, report = check_json(capsys, "--yaml", write_yaml(tmp_path, data))
    assert code == 0 and report["problems"] == [] and report["images"] == 2
    records = json.loads((data / "grounding.json").read_text())
    first_w, first_h = ResizePolicy(MIN, MAX, 28).model_size(3024, 4032)[::-1]
    tall_w = ResizePolicy(MIN, MAX, 28).model_size(1800, 600)[1]
    assert tall_w < first_w - 10
    records[0]["messages"][3]["content"] = '{"action": "click", "point_2d": [%d, 10]}' % (tall_w + 5)
    (data / "grounding.json").write_text(json.dumps(records))
    code, report = check_json(capsys, "--yaml", write_yaml(tmp_path, data))
    assert code == 1 and len(report["problems"]) == 1
    assert report["problems"][0]["image"].endswith("tall.jpg") and "outside" in report["problems"][0]["error"]


@pytest.mark.parametrize("frame", ["original", "model"])
def test_draw_puts_boxes_where_the_labels_say(tmp_path, dataset, capsys, frame):
    assert main(["draw", str(dataset / "grounding.json"), "-o", str(tmp_path / "drawn"), "--frame", frame,
                 "--sample", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["images"]) == 2 and result["contact_sheet"]
    image = cv2.imread(result["images"][0])
    if frame == "original":
        assert image.shape[:2] == (3024, 4032)
        x, y = 2000, 1500
    else:
        h, w = ResizePolicy(MIN, MAX).model_size(3024, 4032)
        assert image.shape[:2] == (h, w)
        x, y = round(2000 * w / 4032), round(1500 * h / 3024)
    b, g, r = (int(v) for v in image[y + 1, x + 30])
    assert g > 150 and r < 120, (b, g, r)  # the green ground-truth edge runs along the box's top


def test_check_counts_image_references_and_distinct_files(tmp_path, capsys):
    """Three questions about one photo: three image references, one file (was reported as three images)."""
    raw = tmp_path / "raw"
    save_image(raw / "a.jpg", 640, 480)
    lines = [{"image": "a.jpg", "question": f"Where is object {k}?", "answer": '[{"bbox_2d": [1, 2, 30, 40]}]'}
             for k in range(3)]
    (raw / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = tmp_path / "data"
    assert main(["convert", str(raw / "in.jsonl"), "-o", str(data / "grounding.json"), "--input-coords", "abs",
                 "--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]) == 0
    capsys.readouterr()  # convert's summary
    code, report = check_json(capsys, "--yaml", write_yaml(tmp_path, data), "--workers", "1")
    assert code == 0 and report["samples"] == 3 and report["images"] == 3 and report["distinct_image_files"] == 1


def test_a_green_truth_box_shows_on_a_green_object(tmp_path, capsys):
    """Issue 25: the green outline vanished on green objects; a dark halo now borders it."""
    raw = tmp_path / "raw"
    save_image(raw / "leaf.jpg", 640, 480, color=(60, 200, 60))  # the truth colour everywhere
    line = {"image": "leaf.jpg", "question": "Where?", "answer": '[{"bbox_2d": [100, 100, 500, 400]}]'}
    (raw / "in.jsonl").write_text(json.dumps(line) + "\n")
    data = tmp_path / "data"
    assert main(["convert", str(raw / "in.jsonl"), "-o", str(data / "grounding.json"), "--input-coords", "abs",
                 "--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]) == 0
    capsys.readouterr()
    assert main(["draw", str(data / "grounding.json"), "-o", str(tmp_path / "drawn"), "--sample", "0"]) == 0
    image = cv2.imread(json.loads(capsys.readouterr().out)["images"][0])
    column = image[90:111, 300].astype(int)  # across the top edge at y = 100
    assert column.max(axis=1).min() < 70, column.tolist()  # dark pixels border the line
    assert any(g > 150 and b < 120 and r < 120 for b, g, r in column.tolist())  # the green line itself



def test_check_refuses_what_training_refuses(tmp_path, dataset, capsys):
    """Issue 22, item 6: check passed a template whose plugin is not Qwen2VLPlugin, ignored the registry entry's
    `columns` and `tags` (LF then loads no images, or cannot read the turns), and read a malformed stamp as
    "unstamped"; training refuses each."""
    code, report = check_json(capsys, "--yaml", write_yaml(tmp_path, dataset, template="llava"))
    assert code == 1 and "uses LF's LlavaPlugin" in report["setup_problems"][0]
    info_path = dataset / "dataset_info.json"
    info = json.loads(info_path.read_text())
    entry = info["grounding"]
    for broken, expected in (({**entry, "columns": {"messages": "messages"}}, "0 image(s)"),
                             ({k: v for k, v in entry.items() if k != "tags"}, "role 'None'"),
                             ({**entry, "formatting": "openai"}, "formatting 'openai'")):
        info_path.write_text(json.dumps({"grounding": broken}))
        code, report = check_json(capsys, "--yaml", write_yaml(tmp_path, dataset))
        problems = [row["error"] for row in report["problems"]] + report["setup_problems"]
        assert code == 1 and problems and all(expected in p for p in problems), problems
    info_path.write_text(json.dumps({"grounding": {**entry, "qwenvl_policy": "max_pixels=802816"}}))
    assert main(["check", "--yaml", str(write_yaml(tmp_path, dataset))]) == 2
    assert "stamp 'max_pixels=802816' is not an object" in capsys.readouterr().err
    info_path.write_text(json.dumps({"grounding": {**entry, "file_name": "."}}))
    assert main(["check", "--yaml", str(write_yaml(tmp_path, dataset))]) == 2
    err = capsys.readouterr().err
    assert "file_name '.', which is a folder" in err and "Traceback" not in err


def test_a_registered_name_is_its_entry_even_beside_a_same_named_file(tmp_path, monkeypatch):
    """Issue 51's review: ``check --yaml`` read a file named like the YAML's dataset in the working directory
    instead of the dataset_info.json entry LF trains on; the entry wins, and a path that is no name stays a file."""
    import json

    from qwenvl_prep.formats.converted import resolve_dataset

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.json").write_text("[]")
    (data / "dataset_info.json").write_text(json.dumps({"sg.jsonl": {"file_name": "train.json"}}))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sg.jsonl").write_text("{}\n")  # a stray file of the same name where check runs
    assert resolve_dataset("sg.jsonl", data).path == data / "train.json"
    assert resolve_dataset(str(tmp_path / "sg.jsonl"), data).path == tmp_path / "sg.jsonl"
