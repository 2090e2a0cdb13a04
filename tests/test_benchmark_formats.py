"""ScreenSpot, ScreenSpot-Pro and RefCOCO parquet through `qwenvl-prep convert`: points or boxes in the model's
frame, the truth box in original pixels and the subset fields in meta, one error row per bad entry."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from helpers import save_image
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
                        "data_source": entry["data_source"]}


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
    _, first, _ = _convert(tmp_path, source, "--refcoco-expressions", "first", "--overwrite")
    assert len(first) == 2


def test_refcoco_parquet_needs_its_columns(tmp_path, capsys):
    source = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1]}), source)
    code = main(["convert", str(source), "-o", str(tmp_path / "o.jsonl"), "--min-pixels", "3136", "--max-pixels",
                 "200704", "-q"])
    assert code == 2 and "missing image, answer, bbox" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
