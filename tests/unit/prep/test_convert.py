"""``qwenvl-prep convert``: formats, conventions, EXIF, bad input, atomicity, idempotence, shards, LF round trip."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
from helpers import save_image
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from llamafactory_qwenvl_patch.scoring.answers import parse_items
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from qwenvl_prep.cli import main

MIN, MAX = 512 * 28 * 28, 1024 * 28 * 28
POLICY = ResizePolicy(MIN, MAX, 28)
FLAGS = ["--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]


def write_lines(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def run(capsys, *args: str) -> tuple[int, dict]:
    code = main([str(a) for a in args])
    out = capsys.readouterr().out
    return code, json.loads(out)


def answers(path: Path) -> list[str]:
    text = path.read_text()
    records = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines()]
    return [m["content"] for r in records for m in r["messages"] if m["role"] == "assistant"]


def sharegpt(image: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": "<image>Find it."}, {"role": "assistant", "content": answer}],
            "images": [image]}


@pytest.fixture()
def wide(tmp_path) -> Path:
    return save_image(tmp_path / "wide.jpg", 2000, 1000)


def test_worked_example_sharegpt_fenced_and_passthrough(tmp_path, wide, capsys):
    src = write_lines(tmp_path / "in.jsonl", [
        sharegpt("wide.jpg", '```json\n[{"bbox_2d": [100, 200, 300, 400], "label": "cat"}]\n```'),
        {"conversations": [{"from": "human", "value": "<image>Invoice number?"}, {"from": "gpt", "value": "INV-7"}],
         "images": ["wide.jpg"]},
        sharegpt("wide.jpg", '[{"point_2d": [1000, 500]}]'),
    ])
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    code, summary = run(capsys, "convert", src, "-o", tmp_path / "data" / "train.json", "--input-coords", "abs", *FLAGS)
    assert code == 0 and summary["written"] == 3 and summary["passthrough"] == 1
    got = answers(tmp_path / "data" / "train.json")
    assert got[0] == '```json\n[{"bbox_2d": [63, 123, 189, 246], "label": "cat"}]\n```'
    assert got[1] == "INV-7"
    assert parse_items(got[2])[0].coords == (630.0, 308.0)
    assert hashlib.sha256(src.read_bytes()).hexdigest() == before
    stamp = json.loads((tmp_path / "data" / "dataset_info.json").read_text())["train"]["qwenvl_policy"]
    assert (stamp["min_pixels"], stamp["max_pixels"], stamp["factor"], stamp["coords"]) == (MIN, MAX, 28, "model")


def test_dataset_info_other_entries_untouched(tmp_path, wide, capsys):
    data = tmp_path / "data"
    data.mkdir()
    other = {"mine": {"file_name": "mine.json", "formatting": "alpaca"}}
    (data / "dataset_info.json").write_text(json.dumps(other))
    src = write_lines(tmp_path / "in.jsonl", [sharegpt("wide.jpg", '[{"bbox_2d": [0, 0, 10, 10]}]')])
    assert run(capsys, "convert", src, "-o", data / "grounding.jsonl", "--input-coords", "abs", *FLAGS)[0] == 0
    info = json.loads((data / "dataset_info.json").read_text())
    assert info["mine"] == other["mine"] and "qwenvl_policy" in info["grounding"]


def test_alpaca_plain_jsonl_and_box_tokens(tmp_path, wide, capsys):
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Find the cat.", "output": '[{"bbox_2d": [0, 0, 1000, 1000]}]',
                                   "images": ["wide.jpg"]}]))
    code, _ = run(capsys, "convert", alpaca, "-o", tmp_path / "a.json", "--input-coords", "rel1000", *FLAGS)
    assert code == 0 and answers(tmp_path / "a.json") == ['[{"bbox_2d": [0, 0, 1260, 616]}]']
    plain = write_lines(tmp_path / "plain.jsonl", [{"image": "wide.jpg", "question": "Where?",
                                                    "answer": '[{"bbox_2d": [0.05, 0.2, 0.15, 0.4]}]'}])
    code, _ = run(capsys, "convert", plain, "-o", tmp_path / "p.jsonl", "--input-coords", "rel1", *FLAGS)
    assert code == 0 and answers(tmp_path / "p.jsonl") == ['[{"bbox_2d": [63, 123, 189, 246]}]']
    tokens = write_lines(tmp_path / "tok.jsonl", [sharegpt(
        "wide.jpg", "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,200),(300,400)<|box_end|>")])
    code, _ = run(capsys, "convert", tokens, "-o", tmp_path / "t.jsonl", "--input-coords", "abs", *FLAGS,
                  "--family", "qwen2_vl")
    assert code == 0
    assert answers(tmp_path / "t.jsonl") == [
        "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(50,200),(150,400)<|box_end|>"]


def test_coco_detection_to_grounding(tmp_path, wide, capsys):
    coco = {"images": [{"id": 1, "file_name": "wide.jpg", "width": 2000, "height": 1000}],
            "categories": [{"id": 3, "name": "car"}, {"id": 5, "name": "dog"}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 3, "bbox": [100, 200, 200, 200], "iscrowd": 0},
                            {"id": 2, "image_id": 1, "category_id": 5, "bbox": [0, 0, 10, 10], "iscrowd": 0},
                            {"id": 3, "image_id": 1, "category_id": 3, "bbox": [0, 0, 50, 50], "iscrowd": 1}]}
    (tmp_path / "instances.json").write_text(json.dumps(coco))
    code, summary = run(capsys, "convert", tmp_path / "instances.json", "-o", tmp_path / "coco.json",
                        "--input-coords", "abs", "--coco-prompt", "Where is the {category}?", "--coco-crowd", "ignore",
                        *FLAGS)
    assert code == 0 and summary["records"] == 2 and summary["boxes"] == 2
    records = json.loads((tmp_path / "coco.json").read_text())
    assert records[0]["messages"][0]["content"] == "<image>Where is the car?"
    assert records[0]["messages"][1]["content"] == '[{"bbox_2d": [63, 123, 189, 246], "label": "car"}]'


def exif_rotated(path: Path) -> Path:
    image = Image.new("RGB", (400, 200), (200, 30, 30))
    exif = image.getexif()
    exif[0x0112] = 6  # stored landscape, displayed rotated 90 degrees clockwise (portrait 200x400)
    image.save(path, exif=exif)
    return path


def test_exif_rotation_error_bake_raw(tmp_path, capsys):
    exif_rotated(tmp_path / "phone.jpg")
    src = write_lines(tmp_path / "in.jsonl", [sharegpt("phone.jpg", '[{"bbox_2d": [0, 0, 200, 400]}]')])
    code, summary = run(capsys, "convert", src, "-o", tmp_path / "out" / "e.jsonl", "--input-coords", "abs", *FLAGS)
    assert code == 1 and summary["dropped"] == 1
    row = json.loads((tmp_path / "out" / "e.jsonl.errors.jsonl").read_text())
    assert "EXIF orientation 6" in row["error"] and row["record"] == 0
    code, summary = run(capsys, "convert", src, "-o", tmp_path / "out" / "b.jsonl", "--input-coords", "abs",
                        "--exif", "bake", *FLAGS)
    assert code == 0 and summary["exif_baked"] == 1
    record = json.loads((tmp_path / "out" / "b.jsonl").read_text())
    baked = tmp_path / "out" / record["images"][0]
    with Image.open(baked) as image:
        assert image.size == (200, 400) and image.getexif().get(0x0112, 1) == 1
    h, w = POLICY.model_size(400, 200)
    assert parse_items(record["messages"][1]["content"])[0].coords == (0, 0, w, h)
    code, _ = run(capsys, "convert", src, "-o", tmp_path / "out" / "r.jsonl", "--input-coords", "rel1000",
                  "--exif", "raw", *FLAGS)
    assert code == 0


BAD = [
    ("missing image", sharegpt("nope.jpg", '[{"bbox_2d": [1, 1, 5, 5]}]'), "file not found"),
    ("unreadable image", sharegpt("junk.jpg", '[{"bbox_2d": [1, 1, 5, 5]}]'), "not a readable image"),
    ("outside", sharegpt("wide.jpg", '[{"bbox_2d": [1, 1, 2001, 5]}]'), "outside the orig frame"),
    ("inverted", sharegpt("wide.jpg", '[{"bbox_2d": [50, 1, 10, 5]}]'), "inverted"),
    ("zero area", sharegpt("wide.jpg", '[{"bbox_2d": [5, 5, 5, 9]}]'), "zero area"),
    ("nan", sharegpt("wide.jpg", '[{"bbox_2d": [NaN, 1, 10, 5]}]'), "not finite"),
    ("aspect ratio", sharegpt("thin.png", '[{"bbox_2d": [1, 1, 5, 5]}]'), "aspect ratio 250.0"),
    ("not json", "{this is not json", "not valid JSON"),
    ("no messages", {"images": ["wide.jpg"]}, "no 'messages'"),
    ("bad answer json", sharegpt("wide.jpg", '[{"bbox_2d": [1, 2, 3}]'), "cannot be read"),
    ("two images", {"messages": [{"role": "user", "content": "<image><image>Find it."},
                                 {"role": "assistant", "content": '[{"bbox_2d": [1, 1, 5, 5]}]'}],
                    "images": ["wide.jpg", "wide.jpg"]}, "after a turn that shows 2 images"),
    ("coordinates before an image", {"messages": [
        {"role": "user", "content": 'Find [{"bbox_2d": [1, 1, 5, 5]}] again.'}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "<image>"}, {"role": "assistant", "content": "sure"},
        {"role": "user", "content": "<image>Now?"}, {"role": "assistant", "content": "done"}],
        "images": ["wide.jpg", "wide.jpg"]}, "turn 1 has coordinates before any image"),
    ("tags and images differ", {**sharegpt("wide.jpg", "no boxes"), "images": ["wide.jpg", "wide.jpg"]},
     "2 image(s) but 1 <image> tag(s)"),
]


def test_a_trajectory_maps_each_turns_coordinates_through_its_own_screenshot(tmp_path, wide, capsys):
    """An agent's trajectory as SFT data: a screenshot a user turn, of another size each (one EXIF-rotated, baked),
    and a click in each answer in that screenshot's pixels: each point goes through its own screenshot's frame;
    text around the actions stays byte for byte."""
    save_image(tmp_path / "tall.jpg", 600, 1800)
    exif_rotated(tmp_path / "phone.jpg")
    click = '{"action": "click", "point_2d": [%s, %s]} '
    record = {"messages": [{"role": "user", "content": "Open settings.<image>Screen 1"},
                           {"role": "assistant", "content": click % (1000, 500) + "first"},
                           {"role": "user", "content": "<image>Screen 2"},
                           {"role": "assistant", "content": click % (300, 1700)},
                           {"role": "user", "content": "no screenshot this turn"},
                           {"role": "assistant", "content": click % (10, 20)},
                           {"role": "user", "content": "<image>Screen 3"},
                           {"role": "assistant", "content": click % (100, 300)}],
              "images": ["wide.jpg", "tall.jpg", "phone.jpg"]}
    src = write_lines(tmp_path / "in.jsonl", [record])
    code, summary = run(capsys, "convert", src, "-o", tmp_path / "out" / "t.jsonl", "--input-coords", "abs",
                        "--exif", "bake", *FLAGS)
    assert code == 0 and summary["points"] == 4 and summary["exif_baked"] == 1
    got = json.loads((tmp_path / "out" / "t.jsonl").read_text())
    texts = [m["content"] for m in got["messages"]]
    for turn, (x, y, hw) in zip((1, 3, 5, 7), [(1000, 500, (1000, 2000)), (300, 1700, (1800, 600)),
                                               (10, 20, (1800, 600)), (100, 300, (400, 200))]):
        mh, mw = POLICY.model_size(*hw)
        assert parse_items(texts[turn])[0].coords == (round(x * mw / hw[1]), round(y * mh / hw[0])), turn
    assert texts[1].endswith("} first") and texts[0] == record["messages"][0]["content"]
    assert texts[4] == "no screenshot this turn"


def test_every_bad_record_gets_a_row_and_no_partial_output(tmp_path, wide, capsys):
    (tmp_path / "junk.jpg").write_bytes(b"not an image at all")
    save_image(tmp_path / "thin.png", 5000, 20)
    good = sharegpt("wide.jpg", '[{"bbox_2d": [1, 1, 5, 5]}]')
    src = write_lines(tmp_path / "in.jsonl", [good] + [record for _, record, _ in BAD])
    out_dir = tmp_path / "out"
    code, summary = run(capsys, "convert", src, "-o", out_dir / "train.json", "--input-coords", "abs", *FLAGS)
    assert code == 1 and summary["dropped"] == len(BAD) and summary["output"] is None
    assert sorted(p.name for p in out_dir.iterdir()) == ["train.json.errors.jsonl"]
    rows = [json.loads(line) for line in (out_dir / "train.json.errors.jsonl").read_text().splitlines()]
    assert [row["record"] for row in rows] == list(range(1, len(BAD) + 1))
    for row, (name, _, expected) in zip(rows, BAD):
        assert expected in row["error"], (name, row)
        assert row["file"] == str(src)
    code, summary = run(capsys, "convert", src, "-o", out_dir / "train.json", "--input-coords", "abs", "--skip-bad",
                        *FLAGS)
    assert code == 0 and summary["written"] == 1 and len(json.loads((out_dir / "train.json").read_text())) == 1


def test_undeclared_convention_is_an_error(tmp_path, wide, capsys):
    src = write_lines(tmp_path / "in.jsonl", [sharegpt("wide.jpg", '[{"bbox_2d": [1, 1, 5, 5]}]')])
    code, summary = run(capsys, "convert", src, "-o", tmp_path / "o.jsonl", *FLAGS)
    assert code == 1
    assert "--input-coords" in (tmp_path / "o.jsonl.errors.jsonl").read_text()


def test_idempotent_on_its_own_output(tmp_path, wide, capsys):
    src = write_lines(tmp_path / "in.jsonl", [sharegpt("wide.jpg", '[{"bbox_2d": [100, 200, 300, 400]}]')])
    data = tmp_path / "data"
    assert run(capsys, "convert", src, "-o", data / "once.jsonl", "--input-coords", "abs", *FLAGS)[0] == 0
    assert run(capsys, "convert", data / "once.jsonl", "-o", data / "twice.jsonl", *FLAGS)[0] == 0
    assert (data / "once.jsonl").read_text() == (data / "twice.jsonl").read_text()
    assert main(["convert", str(data / "once.jsonl"), "-o", str(data / "x.jsonl"), "--input-coords", "abs",
                 *FLAGS]) == 2
    assert "already in that frame" in capsys.readouterr().err
    # Re-targeting a stamped dataset to other bounds goes through the original frame, once.
    small = ["--min-pixels", str(64 * 28 * 28), "--max-pixels", str(256 * 28 * 28), "-q", "--workers", "1"]
    assert run(capsys, "convert", data / "once.jsonl", "-o", data / "small.jsonl", *small)[0] == 0
    direct = tmp_path / "direct"
    assert run(capsys, "convert", src, "-o", direct / "small.jsonl", "--input-coords", "abs", *small)[0] == 0
    assert answers(data / "small.jsonl") == answers(direct / "small.jsonl")


def test_shards_partition_and_workers_agree(tmp_path, wide, capsys):
    """Three chunks of records, so that ``--workers 2`` runs a pool (one chunk runs in the process)."""
    records = [sharegpt("wide.jpg", f'[{{"bbox_2d": [{i % 1990}, 0, {i % 1990 + 10}, 10]}}]') for i in range(2600)]
    src = write_lines(tmp_path / "in.jsonl", records)
    flags = ["--input-coords", "abs", "--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q"]
    assert run(capsys, "convert", src, "-o", tmp_path / "all.jsonl", "--workers", "2", *flags)[0] == 0
    assert run(capsys, "convert", src, "-o", tmp_path / "s0.jsonl", "--shard", "0/2", "--workers", "1", *flags)[0] == 0
    assert run(capsys, "convert", src, "-o", tmp_path / "s1.jsonl", "--shard", "1/2", "--workers", "1", *flags)[0] == 0
    every = answers(tmp_path / "all.jsonl")
    assert len(every) == 2600
    assert answers(tmp_path / "s0.jsonl") == every[0::2] and answers(tmp_path / "s1.jsonl") == every[1::2]
    assert parse_items(every[2599])[0].coords[0] == math.floor(609 * 1260 / 2000 + 0.5)


def test_from_yaml_drives_the_policy(tmp_path, wide, capsys):
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(f"template: qwen3_vl_nothink\nimage_min_pixels: {MIN}\nimage_max_pixels: {MAX}\n"
                         "qwenvl_patch: true\n")
    src = write_lines(tmp_path / "in.jsonl", [sharegpt("wide.jpg", '[{"bbox_2d": [100, 200, 300, 400]}]')])
    code, summary = run(capsys, "convert", src, "-o", tmp_path / "q3.jsonl", "--from-yaml", yaml_path,
                        "--input-coords", "abs", "-q")
    assert code == 0
    assert (summary["stamp"]["factor"], summary["stamp"]["coords"], summary["stamp"]["family"]) == (
        32, "rel1000", "qwen3_vl")
    assert answers(tmp_path / "q3.jsonl") == ['[{"bbox_2d": [50, 200, 150, 400]}]']


@settings(max_examples=40, deadline=None)
@given(w=st.integers(1, 3000), h=st.integers(1, 3000), orientation=st.sampled_from([None, 1, 3, 6, 8]),
       progressive=st.booleans(), icc=st.booleans())
def test_jpeg_header_fast_path_agrees_with_pil(tmp_path_factory, w, h, orientation, progressive, icc):
    from qwenvl_prep.plumbing.imageinfo import _JPEG_SCAN_BYTES, _jpeg_info

    path = tmp_path_factory.mktemp("jpeg") / "x.jpg"
    image = Image.new("RGB", (w, h), (10, 20, 30))
    kwargs = {"progressive": progressive}
    if orientation is not None:
        exif = image.getexif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif
    if icc:
        kwargs["icc_profile"] = bytes(range(256)) * 300  # a large APP2 segment before the frame header
    image.save(path, **kwargs)
    window = path.read_bytes()[:_JPEG_SCAN_BYTES]  # what read_info gives the fast path
    fast = _jpeg_info(window)
    with Image.open(path) as pil:
        expected = (pil.width, pil.height, int(pil.getexif().get(0x0112, 1)))
    if not icc:  # the frame header lies inside the window: the fast path must answer, not hand over to PIL
        assert fast is not None, "the fast path gave up on a plain JPEG"
    if fast is not None:
        assert (fast.width, fast.height, fast.orientation) == expected
    from qwenvl_prep.plumbing.imageinfo import read_info

    info = read_info(path)
    assert (info.width, info.height, info.orientation) == expected


def test_field_extraction_jsonl_image_path_object_answer_and_meta(tmp_path, wide, capsys):
    answer = {"invoice_number": "INV-7", "date": "2024-06-18", "total": 300.0, "items": [{"qty": 2}]}
    metas = [{"vendor": "ACME", "pages": 2}, {"vendor": 7, "note": None}]  # types differ between records
    src = write_lines(tmp_path / "in.jsonl", [
        {"image_path": "wide.jpg", "question": "Extract the fields as JSON.", "answer": answer, "meta": metas[0]},
        {"image_path": "wide.jpg", "question": "Extract the fields as JSON.", "answer": [answer], "meta": metas[1]},
    ])
    out = tmp_path / "data" / "fields.jsonl"
    code, summary = run(capsys, "convert", src, "-o", out, *FLAGS)
    assert code == 0 and summary["passthrough"] == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert answers(out) == [json.dumps(answer, separators=(",", ":")), json.dumps([answer], separators=(",", ":"))]
    assert list(json.loads(answers(out)[0])) == list(answer)  # keys kept in order
    assert [json.loads(row["meta"]) for row in rows] == metas
    assert rows[0]["images"] == [str(wide)] and rows[0]["messages"][0]["content"].startswith("<image>")
    import datasets

    loaded = datasets.load_dataset("json", data_files=str(out), split="train")  # what LF does with the file
    assert len(loaded) == 2


def test_field_extraction_bad_answers_are_error_rows(tmp_path, wide, capsys):
    src = write_lines(tmp_path / "in.jsonl", [
        {"image_path": "wide.jpg", "question": "Q", "answer": 12},
        {"image_path": "wide.jpg", "question": "Q"},
        '{"image_path": "wide.jpg", "question": "Q", "answer": {"a": NaN}}',
    ])
    code, summary = run(capsys, "convert", src, "-o", tmp_path / "out.jsonl", *FLAGS)
    assert code == 1 and summary["dropped"] == 3
    errors = [json.loads(line)["error"] for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert "must be text or a JSON object/array, got int" in errors[0]
    assert "an 'answer'" in errors[1] and "not valid JSON" in errors[2]
