"""Hostile input for qwenvl-prep's commands (issues 11, 22 and 33): boxes that collapse, COCO that is odd,
records that are odd, decompression bombs, coordinates anywhere in a turn, malformed EXIF and stamps, user mistakes
and PIL warnings. Each is a named error (one line, never a traceback), and the rest of the records still convert."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, save_image
from hostile import POLICY, RECORD, run_convert

from llamafactory_qwenvl_patch.image_io.images import ImageError, open_image


def test_tiny_boxes_keep_one_model_pixel_and_pass_check(tmp_path, capsys):
    """Class 3: a valid 1-3 px box on a 4032x3024 photo rounded to zero area (then `check` refused the output).
    Rule: every converted box keeps at least 1 unit of extent per axis, and check agrees."""
    from llamafactory_qwenvl_patch.scoring.answers import parse_items
    from qwenvl_prep.cli import main

    save_image(tmp_path / "photo.jpg", 4032, 3024)
    boxes = [[100, 100, 101, 101], [0, 0, 2, 1], [4029, 3021, 4032, 3024], [2000, 10, 2003, 2000]]
    code, out = run_convert(tmp_path, [{"image": "photo.jpg", "question": "Q",
                                        "answer": json.dumps([{"bbox_2d": b} for b in boxes])}],
                            "--input-coords", "abs")
    assert code == 0
    h, w = POLICY.model_size(3024, 4032)
    items = parse_items(json.loads(out.read_text())[0]["messages"][1]["content"])
    for item in items:
        x1, y1, x2, y2 = item.coords
        assert 0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h, item.coords
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(f"qwenvl_patch: true\nimage_min_pixels: {POLICY.min_pixels}\nimage_max_pixels: "
                         f"{POLICY.max_pixels}\ntemplate: qwen2_vl\ndataset_dir: {out.parent}\ndataset: train\n")
    capsys.readouterr()
    assert main(["check", "--yaml", str(yaml_path), "--json"]) == 0, capsys.readouterr().out


def write_coco(tmp_path, images, annotations):
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": [{"id": 1, "name": "cat"}]}))
    return path


def test_coco_is_absolute_by_definition_and_its_sizes_are_checked(tmp_path, capsys):
    """Class 2: COCO with --input-coords rel1000 produced wrong boxes; a declared size that differs from the file
    (a swapped or resized folder) was never checked."""
    from qwenvl_prep.cli import main

    save_image(tmp_path / "a.jpg", 640, 480)
    save_image(tmp_path / "b.jpg", 480, 640)
    coco = write_coco(tmp_path, [{"id": 1, "file_name": "a.jpg", "width": 640, "height": 480},
                                 {"id": 2, "file_name": "b.jpg", "width": 640, "height": 480}],
                      [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 50, 50]},
                       {"id": 2, "image_id": 2, "category_id": 1, "bbox": [10, 10, 50, 50]}])
    flags = ["--min-pixels", str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels), "-q", "--workers", "1"]
    assert main(["convert", str(coco), "-o", str(tmp_path / "out.json"), "--input-coords", "rel1000", *flags]) == 2
    assert "absolute pixels of the original image by definition" in capsys.readouterr().err
    assert main(["convert", str(coco), "-o", str(tmp_path / "out.json"), *flags]) == 1  # abs implied
    [row] = [json.loads(line) for line in (tmp_path / "out.json.errors.jsonl").read_text().splitlines()]
    assert row["record"] == 1 and "declares image" in row["error"] and "640x480, the file is 480x640" in row["error"]


def test_coco_with_missing_or_null_fields_lists_each_and_converts_the_rest(tmp_path, capsys):
    """Class 7: COCO with missing or null fields aborted the run with a traceback."""
    from qwenvl_prep.cli import main

    for name in ("a.jpg", "b.jpg", "c.jpg"):
        save_image(tmp_path / name, 640, 480)
    coco = write_coco(tmp_path, [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": None},
                                 {"id": 3, "file_name": "c.jpg"}],
                      [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]},
                       {"id": 2, "image_id": 3, "category_id": 1, "bbox": None}])
    code = main(["convert", str(coco), "-o", str(tmp_path / "out.json"), "--skip-bad", "--min-pixels",
                 str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels), "-q", "--workers", "1"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["written"] == 1 and summary["dropped"] == 2
    errors = [json.loads(line)["error"] for line in (tmp_path / "out.json.errors.jsonl").read_text().splitlines()]
    assert "no 'id' or string 'file_name'" in errors[0] and "bbox None" in errors[1]


def test_smaller_record_problems_are_named_error_rows(tmp_path):
    """Class 12: tag/image count mismatch, bad alpaca history, invalid UTF-8, URLs, data URIs, file://localhost and
    NUL bytes each get an error row naming the record; the good records still convert."""
    save_image(tmp_path / "ok.jpg", 640, 480)
    box = '[{"bbox_2d": [1, 2, 30, 40]}]'

    def sharegpt(user, images):
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": box}],
                "images": images}

    lines = [json.dumps(sharegpt("<image>Find it.", ["ok.jpg"])),
             json.dumps(sharegpt("Find it.", ["ok.jpg"])),
             json.dumps(sharegpt("<image><image>Find it.", ["ok.jpg"])),
             json.dumps(sharegpt("<image>Find it.", ["https://example.com/a.jpg"])),
             json.dumps(sharegpt("<image>Find it.", ["data:image/png;base64,AAAA"])),
             json.dumps(sharegpt("<image>Find it.", [f"file://localhost{tmp_path / 'ok.jpg'}"])),
             json.dumps(sharegpt("<image>Find it.", ["o\u0000k.jpg"]))]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b'\n{"messages": "\xff\xfe"}\n')
    from qwenvl_prep.cli import main

    out = tmp_path / "data" / "t.json"
    code = main(["convert", str(src), "-o", str(out), "--input-coords", "abs", "-q", "--workers", "1", "--skip-bad",
                 "--min-pixels", str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels)])
    assert code == 0 and len(json.loads(out.read_text())) == 2  # the BOM line and the file://localhost one
    rows = {row["record"]: row["error"] for row in map(json.loads, Path(f"{out}.errors.jsonl").read_text().splitlines())}
    assert "1 image(s) but 0 <image> tag(s)" in rows[1] and "1 image(s) but 2 <image> tag(s)" in rows[2]
    assert "https URLs are not supported" in rows[3] and "data URLs are not supported" in rows[4]
    assert "NUL byte" in rows[6] and "not valid UTF-8" in rows[7]


def test_alpaca_history_must_be_pairs(tmp_path):
    from qwenvl_prep.formats.records import RecordError, to_record

    bad = to_record({"instruction": "Q", "output": "A", "history": ["just one string"]}, "alpaca")
    assert isinstance(bad, RecordError) and "[prompt, answer] string pairs" in str(bad)


def test_a_decompression_bomb_is_an_error_row_and_the_rest_convert(tmp_path):
    """Class 7: PIL's pixel limit held, but its DecompressionBombError aborted the whole run listing nothing."""
    import zlib

    from PIL import Image

    save_image(tmp_path / "ok.jpg", 640, 480)
    width = height = 20000  # 400 MP of one grey value: a few hundred KB of PNG
    row = b"\x00" + b"\x80" * width
    idat = zlib.compress(row * height, 9)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    (tmp_path / "bomb.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat)
                                        + chunk(b"IEND", b""))
    with pytest.raises(ImageError, match="bomb.png: refused as a decompression bomb"):
        open_image(str(tmp_path / "bomb.png"))
    code, out = run_convert(tmp_path, [RECORD, {**RECORD, "image": "bomb.png"}], "--input-coords", "abs",
                            "--skip-bad")
    assert code == 0 and len(json.loads(out.read_text())) == 1
    [row] = [json.loads(line) for line in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    assert row["record"] == 1 and "decompression bomb" in row["error"]
    assert Image.MAX_IMAGE_PIXELS < width * height / 2  # the limit itself is PIL's, untouched


BOX, POINT = [100, 200, 300, 400], [500, 600]
FORMS = {
    "json after prose": f'The object is at {json.dumps([{"bbox_2d": BOX}])}.',
    "under another key": json.dumps({"objects": [{"bbox_2d": BOX, "label": "a"}]}),
    "double-encoded": json.dumps(json.dumps([{"bbox_2d": BOX}])),
    "second fence": f'```json\n{json.dumps([{"bbox_2d": BOX}])}\n```\nand\n```json\n{json.dumps([{"point_2d": POINT}])}\n```',
    "point with a box": json.dumps([{"bbox_2d": BOX, "point_2d": POINT}]),
    "tokens after a fence": f'```json\n{json.dumps([{"point_2d": POINT}])}\n```'
                            "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,200),(300,400)<|box_end|>",
}


@pytest.mark.parametrize("form", FORMS)
def test_every_coordinate_anywhere_is_converted(tmp_path, form):
    """Class 1: each of these was left in original pixels with exit 0 (and `check` then said OK)."""
    from llamafactory_qwenvl_patch.scoring.answers import parse_items
    from llamafactory_qwenvl_patch.frame.policy import convert_coords

    save_image(tmp_path / "wide.jpg", 2000, 1000)
    text = FORMS[form]
    before = parse_items(text)
    assert before, "the parser shared by rewards and eval sees the coordinates"
    code, out = run_convert(tmp_path, [{"image": "wide.jpg", "question": "Q", "answer": text}], "--input-coords", "abs")
    assert code == 0
    converted = json.loads(out.read_text())[0]["messages"][1]["content"]
    model_hw = POLICY.model_size(1000, 2000)
    expected = [tuple(convert_coords(item.coords, "orig", "model", (1000, 2000), model_hw)) for item in before]
    assert [item.coords for item in parse_items(converted)] == expected
    assert all(a != b for a, b in zip(expected, (item.coords for item in before)))


def test_boxes_in_the_user_turn_are_converted_and_unreadable_ones_are_errors(tmp_path):
    from llamafactory_qwenvl_patch.scoring.answers import parse_items

    save_image(tmp_path / "wide.jpg", 2000, 1000)
    records = [{"messages": [{"role": "user", "content": f'<image>What is at {json.dumps({"bbox_2d": BOX})}? '
                                                         "Output the bbox_2d coordinates in JSON."},
                             {"role": "assistant", "content": "A cat."}], "images": ["wide.jpg"]},
               *[{"messages": [{"role": "user", "content": "<image>Q"}, {"role": "assistant", "content": answer}],
                  "images": ["wide.jpg"]}
                 for answer in ("the box is bbox_2d: (100, 200, 300, 400)", "<|box_start|>(100,200)<|box_end|>")]]
    code, out = run_convert(tmp_path, records, "--input-coords", "abs", "--skip-bad")
    assert code == 0
    [record] = json.loads(out.read_text())
    [item] = parse_items(record["messages"][0]["content"])
    assert list(item.coords) != BOX and "Output the bbox_2d coordinates" in record["messages"][0]["content"]
    errors = {row["record"]: row["error"] for row in map(json.loads, Path(f"{out}.errors.jsonl").read_text().splitlines())}
    assert set(errors) == {1, 2} and all("cannot be read" in e for e in errors.values())


def test_malformed_exif_huge_integers_and_broken_stamps_are_named(tmp_path, capsys):
    """Class 7: a malformed EXIF segment, integers too large for a float and a stamp without `factor` raised from
    deep inside PIL, float() or int() and aborted the run."""
    from PIL import Image

    from qwenvl_prep.cli import main
    from qwenvl_prep.plumbing.imageinfo import read_info

    path = tmp_path / "exif.jpg"
    Image.new("RGB", (64, 48)).save(path)
    data = path.read_bytes()
    payload = b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\xff\xff" + b"\x01\x12" * 8  # offsets pointing nowhere
    segment = b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload
    path.write_bytes(data[:2] + segment + data[2:])
    info = read_info(path)
    assert (info.width, info.height, info.orientation) == (64, 48, 1)
    save_image(tmp_path / "ok.jpg", 640, 480)
    huge = '[{"bbox_2d": [1, 2, ' + "9" * 400 + ", 40]}]"
    code, out = run_convert(tmp_path, [RECORD, {**RECORD, "answer": huge}], "--input-coords", "abs", "--skip-bad")
    assert code == 0
    [row] = [json.loads(line) for line in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    assert row["record"] == 1 and "too large" in row["error"]
    info_path = out.parent / "dataset_info.json"
    registry = json.loads(info_path.read_text())
    del registry["train"]["qwenvl_policy"]["factor"]
    info_path.write_text(json.dumps(registry))
    capsys.readouterr()
    assert main(["eval", str(out), "--predictions", str(tmp_path / "none.jsonl")]) == 2
    assert "qwenvl_policy stamp" in (err := capsys.readouterr().err) and "lacks factor" in err
    assert f"dataset 'train' in {info_path}" in err  # issue 22, item 11: the message names the registry


def test_user_mistakes_are_one_line_not_a_traceback(tmp_path, capsys):
    """Item 9: each of these raised a traceback: an output folder that cannot be made, `eval --json-out DIR`,
    `eval --predictions DIR`, a registry entry with `file_name: "."`, `--coco-prompt` with an unknown placeholder
    (or an <image> tag)."""
    from qwenvl_prep.cli import main

    save_image(tmp_path / "ok.jpg", 640, 480)
    code, out = run_convert(tmp_path, [RECORD], "--input-coords", "abs")
    assert code == 0
    (tmp_path / "a_file").write_text("x")
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text(json.dumps({"predict": "[]"}) + "\n")
    coco = write_coco(tmp_path, [{"id": 1, "file_name": "ok.jpg", "width": 640, "height": 480}],
                      [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]}])
    policy = ["--min-pixels", str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels), "-q"]
    info = json.loads((out.parent / "dataset_info.json").read_text())
    (out.parent / "dataset_info.json").write_text(json.dumps({**info, "dot": {"file_name": "."}}))
    cases = [
        (["convert", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "a_file" / "t.json"), "--input-coords", "abs",
          *policy], "a_file"),
        (["eval", str(out), "--predictions", str(predictions), "--json-out", str(tmp_path)], "is a directory"),
        (["eval", str(out), "--predictions", str(tmp_path)], "is a folder"),
        (["eval", "dot", "--dataset-dir", str(out.parent), "--predictions", str(predictions)], "which is a folder"),
        (["convert", str(coco), "-o", str(tmp_path / "c" / "t.json"), "--coco-prompt", "Find {thing}.", *policy],
         "--coco-prompt 'Find {thing}.': the only placeholder is {category}"),
        (["convert", str(coco), "-o", str(tmp_path / "c" / "t.json"), "--coco-prompt", "<image>Find {category}.",
          *policy], "--coco-prompt must not contain <image>"),
    ]
    for args, expected in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, (args, err)
    assert not (tmp_path / "c").exists()


def test_pil_warnings_are_one_line_naming_the_image(tmp_path):
    """Item 9: PIL's raw warnings (with a library source line) reached stderr without the image's name."""
    from PIL import Image

    path = tmp_path / "exif.jpg"
    Image.new("RGB", (640, 480)).save(path)
    data = path.read_bytes()
    payload = b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\xff\xff" + b"\x01\x12" * 8  # offsets pointing nowhere
    path.write_bytes(data[:2] + b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload + data[2:])
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({**RECORD, "image": "exif.jpg"}) + "\n")
    result = subprocess.run([str(BIN / "qwenvl-prep"), "convert", str(src), "-o", str(tmp_path / "d" / "t.json"),
                             "--input-coords", "abs", "-q", "--workers", "1", "--min-pixels", str(POLICY.min_pixels),
                             "--max-pixels", str(POLICY.max_pixels)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("qwenvl-prep convert: warning: image ") and "exif.jpg: Corrupt EXIF data" in line


def test_draw_refuses_predictions_that_do_not_line_up(tmp_path, capsys):
    """Item 10: draw --predictions drew any file's predictions on the dataset (eval refused the same mismatch)."""
    from qwenvl_prep.cli import main

    save_image(tmp_path / "ok.jpg", 640, 480)
    code, out = run_convert(tmp_path, [RECORD, {**RECORD, "question": "Again."}], "--input-coords", "abs")
    assert code == 0
    label = json.loads(out.read_text())[0]["messages"][1]["content"]
    for rows, expected in (([{"predict": label, "label": label}], "different numbers of records"),
                           ([{"predict": label, "label": "[]"}] * 2, "predictions row 0 of")):
        predictions = tmp_path / "predictions.jsonl"
        predictions.write_text("".join(json.dumps(row) + "\n" for row in rows))
        assert main(["draw", str(out), "-o", str(tmp_path / "drawn"), "--predictions", str(predictions)]) == 2
        assert expected in capsys.readouterr().err and not (tmp_path / "drawn").exists()


def test_small_things(tmp_path, capsys):
    """Item 11: a negative --workers or --sample was accepted; eval refused a byte-order mark that convert
    accepts."""
    from qwenvl_prep.cli import main

    save_image(tmp_path / "ok.jpg", 640, 480)
    code, out = run_convert(tmp_path, [RECORD], "--input-coords", "abs")
    for args in (["convert", "in.jsonl", "-o", "x.json", "--workers", "-1"], ["check", "--yaml", "y", "--workers", "0"],
                 ["draw", str(out), "-o", str(tmp_path / "drawn"), "--sample", "-3"]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2 and "must be at least" in capsys.readouterr().err
    label = json.loads(out.read_text())[0]["messages"][1]["content"]
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_bytes(b"\xef\xbb\xbf" + json.dumps({"predict": label, "label": label}).encode() + b"\n")
    assert main(["eval", str(out), "--predictions", str(predictions), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"]["acc@0.5"] == 1.0


def test_a_single_chunk_starts_no_pool(tmp_path, monkeypatch, capsys):
    """Issue 33, class 11: a one-record convert with the default pool hung, once in about 20 runs under load, in
    ``Pool.terminate``. A single chunk cannot be shared out, so it converts in the process: no pool to stop."""
    from qwenvl_prep.pipeline import convert

    def no_pool():
        raise AssertionError("a pool was started for one chunk")

    monkeypatch.setattr(convert, "_pool_context", no_pool)
    save_image(tmp_path / "ok.jpg", 640, 480)
    code, _ = run_convert(tmp_path, [RECORD] * 3, "--input-coords", "abs", "--workers", "4")
    assert code == 0 and len(json.loads((tmp_path / "data" / "train.json").read_text())) == 3
