"""ScreenSpot, ScreenSpot-Pro and RefCOCO parquet through `qwenvl-prep convert`: points or boxes in the model's
frame, the truth box in original pixels and the subset fields in meta, one error row per bad entry."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from helpers import png_header_bomb, save_image
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from qwenvl_prep.cli import main

POLICY = ResizePolicy(3136, 200704)


def _convert(tmp_path, source, *extra):
    out = tmp_path / "out" / "data.jsonl"
    code = main(["convert", str(source), "-o", str(out), "--min-pixels", "3136", "--max-pixels", "200704",
                 "--workers", "1", "-q", "--skip-bad", *extra])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    errors = out.with_name(out.name + ".errors.jsonl")
    return code, rows, [json.loads(line) for line in errors.read_text().splitlines()] if errors.exists() else []


def _screens(tmp_path):
    save_image(tmp_path / "desktop.png", 1920, 1080)
    save_image(tmp_path / "phone.png", 1170, 2532)
    return {"desktop.png": (1080, 1920), "phone.png": (2532, 1170)}


def _answer_coords(row):
    return json.loads(row["messages"][1]["content"])[0]


def test_screenspot_points_in_the_model_frame(tmp_path, capsys):
    sizes = _screens(tmp_path)
    entries = [
        {"img_filename": "desktop.png", "bbox": [1700, 20, 60, 30], "instruction": "close the window",
         "data_type": "icon", "data_source": "windows"},
        {"img_filename": "phone.png", "bbox": [100, 2300, 300, 120], "instruction": "open settings",
         "data_type": "text", "data_source": "ios"},
        {"img_filename": "phone.png", "bbox": [10, 10, 0, 5], "instruction": "nothing", "data_type": "text"},
        {"img_filename": "desktop.png", "bbox": [1, 2, 3, 4], "instruction": ""},
    ]
    source = tmp_path / "screenspot_mobile.json"
    source.write_text(json.dumps(entries))
    code, rows, errors = _convert(tmp_path, source)
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["points"] == 2 and len(rows) == 2
    assert [e["record"] for e in errors] == [2, 3]
    assert "no area" in errors[0]["error"] and "instruction" in errors[1]["error"]
    for row, entry in zip(rows, entries):
        hw = sizes[entry["img_filename"]]
        x, y, w, h = entry["bbox"]
        expected = convert_coords([x + w / 2, y + h / 2], "orig", "model", hw, POLICY.model_size(*hw))
        assert _answer_coords(row) == {"point_2d": expected}
        assert entry["instruction"] in row["messages"][0]["content"]
        meta = json.loads(row["meta"])
        assert meta == {"bbox_orig": [x, y, x + w, y + h], "data_type": entry["data_type"],
                        "data_source": entry["data_source"], "instruction": entry["instruction"],
                        "source_format": "screenspot"}  # the instruction, for predict --prompt-preset


def test_screenspot_pro_boxes_and_declared_size(tmp_path):
    _screens(tmp_path)
    entries = [
        {"img_filename": "desktop.png", "bbox": [1700, 20, 1760, 50], "img_size": [1920, 1080], "id": "a",
         "instruction": "close", "ui_type": "icon", "group": "Dev", "application": "vscode", "platform": "macos"},
        {"img_filename": "desktop.png", "bbox": [1700, 20, 1760, 50], "img_size": [2560, 1440], "id": "b",
         "instruction": "close", "ui_type": "icon", "group": "Dev", "application": "vscode", "platform": "macos"},
    ]
    source = tmp_path / "vscode_macos.json"
    source.write_text(json.dumps(entries))
    code, rows, errors = _convert(tmp_path, source, "--target", "box")
    assert code == 0 and len(rows) == 1
    model_hw = POLICY.model_size(1080, 1920)
    assert _answer_coords(rows[0]) == {"bbox_2d": convert_coords([1700, 20, 1760, 50], "orig", "model",
                                                                 (1080, 1920), model_hw)}
    assert json.loads(rows[0]["meta"])["application"] == "vscode"
    assert "declares image" in errors[0]["error"] and "2560x1440" in errors[0]["error"]


def _png(width, height, color):
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


def test_refcoco_parquet(tmp_path):
    shared = _png(640, 427, (10, 200, 30))
    table = pa.table({
        "question_id": ["1", "2", "3"],
        "image": [{"bytes": shared, "path": "../../x.png"}, {"bytes": shared, "path": None},
                  {"bytes": b"not an image", "path": None}],
        "answer": [["left dog", "the brown dog"], ["man on the right"], ["cat"]],
        "bbox": [[10.0, 20.0, 100.0, 50.5], [300.0, 40.0, 200.0, 300.0], [1.0, 1.0, 2.0, 2.0]],
        "file_name": ["COCO_1.jpg", "COCO_1.jpg", "COCO_2.jpg"],
    })
    source = tmp_path / "refcoco_val.parquet"
    pq.write_table(table, source)
    code, rows, errors = _convert(tmp_path, source)
    assert code == 0 and len(rows) == 3 and len(errors) == 1 and "not a readable image" in errors[0]["error"]
    images = sorted((tmp_path / "out" / "data_images").iterdir())
    assert len(images) == 1 and images[0].read_bytes() == shared  # written once, byte for byte
    assert {row["images"][0] for row in rows} == {f"data_images/{images[0].name}"}
    model_hw = POLICY.model_size(427, 640)
    assert _answer_coords(rows[0]) == {"bbox_2d": convert_coords([10, 20, 110, 70.5], "orig", "model", (427, 640),
                                                                 model_hw)}
    assert "the brown dog" in rows[1]["messages"][0]["content"]
    assert json.loads(rows[2]["meta"])["question_id"] == "2"
    assert [json.loads(row["meta"])["instruction"] for row in rows] == ["left dog", "the brown dog", "man on the right"]
    assert {json.loads(row["meta"])["source_format"] for row in rows} == {"refcoco-parquet"}
    _, first, _ = _convert(tmp_path, source, "--refcoco-expressions", "first", "--overwrite")
    assert len(first) == 2
    # the published prompt of each family that answers in JSON, as convert's labels do
    _, qwen3, _ = _convert(tmp_path, source, "--prompt-preset", "refcoco", "--family", "qwen3_vl", "--overwrite")
    assert qwen3[1]["messages"][0]["content"] == ('<image>Locate every object that matches the description "the '
                                                  'brown dog" in the image. Report bbox coordinates in JSON format.')
    assert set(_answer_coords(qwen3[1])) == {"bbox_2d"}
    _, qwen25, _ = _convert(tmp_path, source, "--prompt-preset", "refcoco", "--family", "qwen2_5_vl", "--overwrite")
    assert qwen25[2]["messages"][0]["content"] == ("<image>Locate man on the right in this image and output the bbox "
                                                   "coordinates in JSON format.")


@pytest.mark.parametrize("args, why", [
    (["--format", "screenspot", "--family", "qwen2_5_vl"], "convert writes bbox_2d / point_2d JSON labels"),
    (["--format", "screenspot", "--family", "qwen3_vl"], "no Qwen3-VL ScreenSpot prompt is published"),
    (["--format", "screenspot", "--family", "qwen2_vl"], "answered with <|box_start|>"),
    (["--format", "screenspot", "--family", "qwen3_5", "--prompt-preset", "refcoco"], "is for refcoco-parquet input"),
    (["--format", "screenspot", "--target", "box"], "without --prompt and --target"),
])
def test_a_preset_convert_cannot_honour_is_refused(tmp_path, capsys, args, why):
    """A preset answered otherwise than convert's labels, for another benchmark, for a family no source gives a
    prompt for, or beside --prompt / --target: one line naming why, and nothing written."""
    _screens(tmp_path)
    source = tmp_path / "ss.json"
    source.write_text(json.dumps([{"img_filename": "desktop.png", "bbox": [10, 10, 50, 20], "instruction": "open",
                                   "data_type": "text"}]))
    preset = [] if "--prompt-preset" in args else ["--prompt-preset", "screenspot"]
    out = tmp_path / "out" / "data.jsonl"
    code = main(["convert", str(source), "-o", str(out), "--min-pixels", "3136", "--max-pixels", "200704", "-q",
                 *preset, *args])
    assert code != 0 and not out.exists()
    assert why in capsys.readouterr().err


def test_refcoco_parquet_needs_its_columns(tmp_path, capsys):
    source = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1]}), source)
    code = main(["convert", str(source), "-o", str(tmp_path / "o.jsonl"), "--min-pixels", "3136", "--max-pixels",
                 "200704", "-q"])
    assert code == 2 and "missing image, answer, bbox" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def _predictions(path, texts):
    path.write_text("".join(json.dumps({"predict": text}) + "\n" for text in texts))
    return path


def test_eval_click_accuracy_by_subset(tmp_path, capsys):
    sizes = _screens(tmp_path)
    entries = [{"img_filename": name, "bbox": [400, 300, 200, 100], "instruction": f"button {i}",
                "data_type": kind, "data_source": source}
               for i, (name, kind, source) in enumerate([("desktop.png", "icon", "windows"),
                                                         ("desktop.png", "text", "windows"),
                                                         ("phone.png", "icon", "ios"), ("phone.png", "text", "ios")])]
    source = tmp_path / "screenspot.json"
    source.write_text(json.dumps(entries))
    _convert(tmp_path, source)
    capsys.readouterr()

    def model(name, x, y):
        hw = sizes[name]
        return convert_coords([x, y], "orig", "model", hw, POLICY.model_size(*hw))

    texts = [json.dumps([{"point_2d": model("desktop.png", 500, 350)}]),  # centre: hit
             json.dumps([{"point_2d": model("desktop.png", 900, 900)}]),  # miss
             json.dumps(model("phone.png", 410, 310)),  # bare [x, y] near the corner: hit
             "I cannot see it"]  # no click
    predictions = _predictions(tmp_path / "pred.jsonl", texts)
    out = tmp_path / "out"
    assert main(["eval", str(out / "data.jsonl"), "--predictions", str(predictions), "--by", "data_source",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["clicks"] == {"samples": 4, "click_acc": 0.5, "click_dense_mean": pytest.approx(0.5, abs=0.01),
                                "no_click_rate": 0.25}
    assert result["by"]["data_source=windows"]["clicks"]["click_acc"] == 0.5
    assert result["by"]["data_source=ios"]["clicks"]["click_acc"] == 0.5
    assert "overall" not in result  # point answers: no box metrics
    assert main(["eval", str(out / "data.jsonl"), "--predictions", str(predictions), "--by", "data_type"]) == 0
    table = capsys.readouterr().out
    assert "data_type=icon" in table and "click acc" in table


def test_eval_detection_precision_recall_map_and_monitors(tmp_path, capsys):
    save_image(tmp_path / "a.png", 1280, 960)
    save_image(tmp_path / "b.png", 1280, 960)
    truth_a = [{"bbox_2d": [100, 100, 400, 300], "label": "cat"}, {"bbox_2d": [600, 200, 900, 600], "label": "dog"},
               {"bbox_2d": [200, 500, 500, 900], "label": "cat"}]
    truth_b = [{"bbox_2d": [100, 100, 400, 300], "label": "cat"}, {"bbox_2d": [600, 200, 900, 600], "label": "dog"}]
    records = [{"image": name, "question": "<image>Find every cat and dog.", "answer": json.dumps(truth)}
               for name, truth in [("a.png", truth_a), ("b.png", truth_b)]]
    source = tmp_path / "pets.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    _convert(tmp_path, source, "--input-coords", "abs")
    capsys.readouterr()
    rows = [json.loads(line) for line in (tmp_path / "out" / "data.jsonl").read_text().splitlines()]
    model_hw = POLICY.model_size(960, 1280)
    whole = convert_coords([0, 0, 1280, 960], "orig", "model", (960, 1280), model_hw)
    answer_b = json.loads(rows[1]["messages"][1]["content"])
    answer_b[1]["label"] = "cat"  # right place, wrong label
    answer_b.append({"bbox_2d": whole, "label": "dog"})
    predictions = _predictions(tmp_path / "pred.jsonl", [rows[0]["messages"][1]["content"], json.dumps(answer_b)])
    assert main(["eval", str(tmp_path / "out" / "data.jsonl"), "--predictions", str(predictions), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    detection = result["detection"]
    assert (detection["truth_boxes"], detection["predicted_boxes"]) == (5, 6)
    assert detection["precision@0.5"] == pytest.approx(4 / 6, abs=1e-4)
    assert detection["recall@0.5"] == pytest.approx(4 / 5, abs=1e-4)
    assert detection["f1@0.5"] == pytest.approx(8 / 11, abs=1e-4)
    # cat: 3 of 4 boxes right, every truth found (AP 0.75); dog: 1 of 2 right, half found (0.5 x 51/101 points)
    assert detection["map"] == pytest.approx((0.75 + 0.5 * 51 / 101) / 2, abs=0.01)
    assert detection["ap50"] >= detection["map"] and "pycocotools_map" in detection
    assert result["monitors"]["whole_image_rate"] == 0.5 and result["monitors"]["empty_answer_rate"] == 0.0
    assert result["monitors"]["count_ratio"] == pytest.approx(6 / 5)
    perfect = _predictions(tmp_path / "perfect.jsonl", [row["messages"][1]["content"] for row in rows])
    assert main(["eval", str(tmp_path / "out" / "data.jsonl"), "--predictions", str(perfect), "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["detection"]
    assert best["map"] == 1.0 and best["f1@0.5"] == 1.0


def test_draw_shows_the_click_target_and_the_click(tmp_path):
    from qwenvl_prep.formats.converted import resolve_dataset, iter_samples
    from qwenvl_prep.pipeline.draw import GT_COLOR, PRED_COLOR, render

    _screens(tmp_path)
    source = tmp_path / "screenspot.json"
    source.write_text(json.dumps([{"img_filename": "desktop.png", "bbox": [400, 300, 200, 100],
                                   "instruction": "save", "data_type": "icon"}]))
    _convert(tmp_path, source)
    ref = resolve_dataset(str(tmp_path / "out" / "data.jsonl"))
    sample = next(iter_samples(ref))
    click = convert_coords([1000, 800], "orig", "model", (1080, 1920), POLICY.model_size(1080, 1920))
    canvas = render(sample, ref.stamp, "original", json.dumps(click))  # a bare [x, y] prediction
    assert tuple(canvas[300, 500]) == GT_COLOR  # the target's top edge, from meta.bbox_orig
    assert tuple(canvas[800, 1000]) == PRED_COLOR  # the click


def test_hostile_benchmark_entries_are_error_rows(tmp_path, capsys):
    _screens(tmp_path)
    entries = [
        {"img_filename": "desktop.png", "bbox": [10, 10, 50, 20], "instruction": "open <image> twice"},
        {"img_filename": "desktop.png", "bbox": [10, 10, 50, 20], "instruction": "save",
         "bbox_orig": [0, 0, 1920, 1080]},  # an entry's own key never replaces the truth box
    ]
    source = tmp_path / "screenspot.json"
    source.write_text(json.dumps(entries))
    code, rows, errors = _convert(tmp_path, source)
    assert code == 0 and len(rows) == 1 and "<image>" in errors[0]["error"]
    assert json.loads(rows[0]["meta"])["bbox_orig"] == [10, 10, 60, 30]
    capsys.readouterr()
    for prompt in ("Click it.", "<image>Click {instruction}"):
        code = main(["convert", str(source), "-o", str(tmp_path / "p.jsonl"), "--min-pixels", "3136",
                     "--max-pixels", "200704", "-q", "--prompt", prompt])
        assert code == 2 and "--prompt" in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl").exists()


def test_a_damaged_parquet_file_is_one_line(tmp_path, capsys):
    good = io.BytesIO()
    pq.write_table(pa.table({"image": [{"bytes": _png(64, 48, (1, 2, 3)), "path": None}] * 40,
                             "answer": [["thing"]] * 40, "bbox": [[1.0, 1.0, 10.0, 10.0]] * 40}), good,
                   row_group_size=8)
    data = bytearray(good.getvalue())
    start = pq.ParquetFile(io.BytesIO(bytes(data))).metadata.row_group(3).column(0).data_page_offset
    data[start:start + 64] = b"\xff" * 64  # the fourth row group's first page is garbage; the footer is intact
    source = tmp_path / "broken.parquet"
    source.write_bytes(bytes(data))
    code = main(["convert", str(source), "-o", str(tmp_path / "out" / "b.jsonl"), "--min-pixels", "3136",
                 "--max-pixels", "200704", "-q", "--workers", "1"])
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err
    rows = [json.loads(line) for line in (tmp_path / "out" / "b.jsonl.errors.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and "cannot be read from here on" in rows[0]["error"]


@pytest.mark.parametrize("bbox", [[1e308, 2, 1e308, 4], [1e308, 2, 3, 4], [1, 2, 3, 1e9]])
def test_a_huge_screenspot_bbox_is_named_as_such(tmp_path, bbox):
    """Issue 33, class 10: a bbox of 1e308 was reported as "'meta' is not JSON-serialisable" (x + w overflowed to
    inf) or as having no area (1e308 + 3 == 1e308)."""
    from PIL import Image

    from qwenvl_prep.cli import main

    Image.new("RGB", (1920, 1080)).save(tmp_path / "s.png")
    src = tmp_path / "ss.json"
    src.write_text(json.dumps([{"img_filename": "s.png", "bbox": bbox, "instruction": "click the button",
                                "data_type": "text", "data_source": "web"}]))
    out = tmp_path / "out" / "t.json"
    assert main(["convert", str(src), "-o", str(out), "--min-pixels", "200704", "--max-pixels", "1003520", "-q",
                 "--workers", "1"]) == 1
    [row] = [json.loads(line) for line in out.with_name("t.json.errors.jsonl").read_text().splitlines()]
    assert "beyond 1e+06 px" in row["error"] and row["record"] == 0, row


def test_a_decompression_bomb_in_a_parquet_row_is_that_rows_error(tmp_path):
    """Issue 33, class 3: a header bomb in a RefCOCO row gave PIL's DecompressionBombError traceback."""
    table = pa.table({"image": [{"bytes": png_header_bomb(), "path": None},
                                {"bytes": _png(64, 48, (1, 2, 3)), "path": None}],
                      "answer": [["a"], ["b"]], "bbox": [[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 20.0, 20.0]]})
    source = tmp_path / "bomb.parquet"
    pq.write_table(table, source)
    code, rows, errors = _convert(tmp_path, source)
    assert code == 0 and len(rows) == 1 and len(errors) == 1
    assert "decompression bomb" in errors[0]["error"] and errors[0]["record"] == 0, errors


def _parquet(path, images: list[bytes], bad_last: bool = False):
    boxes = [[1.0, 1.0, 20.0, 20.0]] * len(images)
    if bad_last:
        boxes[-1] = [1.0, 1.0, -5.0, 2.0]  # a box without area: that row is refused
    pq.write_table(pa.table({"image": [{"bytes": b, "path": None} for b in images],
                             "answer": [["a"]] * len(images), "bbox": boxes}), path)
    return path


def test_a_refused_parquet_convert_leaves_no_images(tmp_path, capsys):
    """Issue 33, class 4: RefCOCO's ``<stem>_images`` folder was filled before the records were judged and never
    cleaned: a refused convert (one bad row, no --skip-bad) left images behind. Now the images this run added go with
    the output it did not write, and an earlier run's images stay."""
    out = tmp_path / "out" / "data.jsonl"
    flags = ["--min-pixels", "3136", "--max-pixels", "200704", "--workers", "1", "-q"]
    first = _png(64, 48, (1, 2, 3))
    assert main(["convert", str(_parquet(tmp_path / "ok.parquet", [first])), "-o", str(out), *flags]) == 0
    kept = {p.name: p.read_bytes() for p in (tmp_path / "out" / "data_images").iterdir()}
    others = [_png(64 + i, 48, (9, 9, i)) for i in range(3)]
    source = _parquet(tmp_path / "bad.parquet", [first, *others], bad_last=True)
    assert main(["convert", str(source), "-o", str(out), "--overwrite", *flags]) == 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "out" / "data_images").iterdir()} == kept
    fresh = tmp_path / "fresh" / "data.jsonl"
    assert main(["convert", str(source), "-o", str(fresh), *flags]) == 1
    assert sorted(p.name for p in fresh.parent.iterdir()) == ["data.jsonl.errors.jsonl"]  # no image, no folder
    capsys.readouterr()


def test_an_images_folder_that_is_a_link_is_refused(tmp_path, capsys):
    """Issue 33, class 4: a ``<stem>_images`` symlink had the images land in its target."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "data_images").symlink_to(elsewhere)
    source = _parquet(tmp_path / "ok.parquet", [_png(64, 48, (1, 2, 3))])
    code = main(["convert", str(source), "-o", str(tmp_path / "out" / "data.jsonl"), "--min-pixels", "3136",
                 "--max-pixels", "200704", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "data_images" in err and "symbolic link" in err and "Traceback" not in err
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "out" / "data.jsonl").exists()


def test_sigterm_during_a_parquet_convert_leaves_no_images(tmp_path):
    """Issue 33, class 4: a SIGTERM mid-run left the images written so far."""
    import signal
    import subprocess
    import sys
    import time

    rows = [_png(200 + i % 97, 150 + i // 97, (i % 250, 3, 4)) for i in range(3000)]
    source = _parquet(tmp_path / "big.parquet", rows)
    out = tmp_path / "out" / "data.jsonl"
    process = subprocess.Popen([sys.executable, "-m", "qwenvl_prep.cli", "convert", str(source), "-o", str(out),
                                "--min-pixels", "3136", "--max-pixels", "200704", "-q"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = out.parent / "data_images"
    deadline = time.monotonic() + 120
    while (not folder.is_dir() or len(list(folder.iterdir())) < 20) and process.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "convert finished before it could be interrupted; give it more rows"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert not folder.exists() and list(out.parent.iterdir()) == []
