"""COCO instances: the standard layouts without flags, what the summary counts, "not present" samples, and ids that
cannot be tied to a sample without guessing (each an error row, never a box on the wrong image)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import save_image
from PIL import Image

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.scoring.answers import parse_items
from qwenvl_prep.cli import main

POLICY = ResizePolicy(128 * 28 * 28, 512 * 28 * 28, 28)
FLAGS = ["--min-pixels", str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels), "-q", "--workers", "1"]
CATEGORIES = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}, {"id": 3, "name": "car"}]


def coco_file(path: Path, images: list, annotations: list, categories: list = CATEGORIES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return path


def image(image_id, name: str, width: int = 640, height: int = 480) -> dict:
    return {"id": image_id, "file_name": name, "width": width, "height": height}


def box(ann_id: int, image_id, category_id=1, bbox=(10, 20, 100, 50), **extra) -> dict:
    return {"id": ann_id, "image_id": image_id, "category_id": category_id, "bbox": list(bbox), **extra}


def convert(capsys, src: Path, out: Path, *flags: str) -> tuple[int, dict | None, str]:
    code = main(["convert", str(src), "-o", str(out), *FLAGS, *flags])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out.strip() else None, captured.err


def records(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def error_rows(out: Path) -> list[dict]:
    report = out.with_name(out.name + ".errors.jsonl")
    return [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []


LAYOUTS = {  # name: (the JSON, the image folder, file_name prefix)
    "coco2017": ("annotations/instances_val2017.json", "val2017", ""),
    "coco2017-under-images": ("annotations/instances_val2017.json", "images/val2017", ""),
    "cvat": ("annotations/instances_default.json", "images", ""),
    "roboflow": ("valid/_annotations.coco.json", "valid", ""),
    "file-name-with-folder": ("annotations/instances_train.json", "", "train/"),
    "label-studio": ("result.json", "", "images/"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_standard_layouts_find_their_images_without_flags(tmp_path, capsys, layout):
    json_rel, folder, prefix = LAYOUTS[layout]
    root = tmp_path / "my_coco"
    for n in (1, 2):
        save_image(root / folder / f"{prefix}{n:012d}.jpg", 640, 480)
    src = coco_file(root / json_rel, [image(1, f"{prefix}{1:012d}.jpg"), image(2, f"{prefix}{2:012d}.jpg")],
                    [box(1, 1), box(2, 2, 2)])
    code, summary, err = convert(capsys, src, tmp_path / "data" / "train.json")
    assert code == 0, err
    coco = summary["coco"]
    assert coco["image_dir"] == str((root / folder).resolve()) and coco["image_dir_from"] == "found"
    for record in records(tmp_path / "data" / "train.json"):
        assert Path(record["images"][0]).is_file() and Path(record["images"][0]).is_relative_to(root.resolve())
    assert "2 samples with boxes" in err


def test_a_folder_that_holds_no_image_names_image_dir(tmp_path, capsys):
    src = coco_file(tmp_path / "my_coco" / "annotations" / "instances_val2017.json", [image(1, "a.jpg")], [box(1, 1)])
    save_image(tmp_path / "elsewhere" / "a.jpg", 640, 480)
    code, _, err = convert(capsys, src, tmp_path / "data" / "train.json")
    assert code == 2 and "--image-dir" in err and "'a.jpg'" in err and len(err.strip().splitlines()) == 1
    code, summary, err = convert(capsys, src, tmp_path / "data" / "train.json", "--image-dir",
                                 str(tmp_path / "elsewhere"))
    assert code == 0 and summary["coco"]["image_dir_from"] == "--image-dir", err


def test_two_folders_holding_the_images_is_refused(tmp_path, capsys):
    root = tmp_path / "my_coco"
    src = coco_file(root / "annotations" / "instances_val2017.json", [image(1, "a.jpg")], [box(1, 1)])
    save_image(root / "val2017" / "a.jpg", 640, 480)
    save_image(root / "images" / "a.jpg", 640, 480, color=(1, 2, 3))
    code, _, err = convert(capsys, src, tmp_path / "data" / "train.json")
    assert code == 2 and "under both" in err and "--image-dir" in err
    assert not (tmp_path / "data").exists()
    (root / "images" / "a.jpg").unlink()
    (root / "images" / "a.jpg").symlink_to(root / "val2017" / "a.jpg")  # the same file twice is no ambiguity
    assert convert(capsys, src, tmp_path / "data" / "train.json")[0] == 0


@pytest.mark.parametrize("mode, kept", [("drop", ["dog"]), ("ignore", ["cat", "dog"]), ("box", ["cat", "dog"])])
def test_the_summary_counts_crowd_regions_and_images_without_annotations(tmp_path, capsys, mode, kept):
    for name in ("a.jpg", "b.jpg", "c.jpg"):
        save_image(tmp_path / name, 640, 480)
    src = coco_file(tmp_path / "instances.json", [image(1, "a.jpg"), image(2, "b.jpg"), image(3, "c.jpg")],
                    [box(1, 1, 1), box(2, 1, 1, (300, 300, 200, 100), iscrowd=1), box(3, 1, 2),
                     box(4, 2, 1, iscrowd=1)])
    code, summary, err = convert(capsys, src, tmp_path / "out.json", "--coco-crowd", mode)
    assert code == 0, err
    coco = summary["coco"]
    assert (coco["images"], coco["annotations"], coco["images_without_annotations"]) == (3, 4, 1)
    assert coco["crowd_annotations"] == 2 and coco["crowd_mode"] == mode
    assert coco["samples_dropped_for_crowd"] == (2 if mode == "drop" else 0)
    got = records(tmp_path / "out.json")
    on_a = [json.loads(r["messages"][1]["content"])[0]["label"] for r in got if r["images"][0].endswith("a.jpg")]
    assert sorted(on_a) == kept
    cats = [json.loads(r["messages"][1]["content"]) for r in got if "every cat " in r["messages"][0]["content"]]
    assert [len(c) for c in cats] == {"drop": [], "ignore": [1], "box": [2, 1]}[mode]
    assert "1 images have no annotation and gave no sample (--coco-absent" in err
    if mode == "drop":
        assert "2 samples with crowd regions not written" in err


def test_not_present_samples_ask_for_absent_categories(tmp_path, capsys):
    categories = [{"id": k, "name": name} for k, name in enumerate(["cat", "dog", "car", "bus", "cup"], start=1)]
    for name in ("a.jpg", "b.jpg"):
        save_image(tmp_path / name, 640, 480)
    src = coco_file(tmp_path / "instances.json", [image(1, "a.jpg"), image(2, "b.jpg")],
                    [box(1, 1, 1), box(2, 1, 2, iscrowd=1)], categories)
    outputs = []
    for run in range(2):
        code, summary, err = convert(capsys, src, tmp_path / f"out{run}.json", "--coco-absent", "2")
        assert code == 0, err
        outputs.append((tmp_path / f"out{run}.json").read_text())
    assert outputs[0] == outputs[1]  # seeded by the image id: the same samples every time
    assert summary["coco"]["samples_not_present"] == 4 and summary["coco"]["samples_with_boxes"] == 1
    absent = [r for r in records(tmp_path / "out0.json") if r["messages"][1]["content"] == "[]"]
    asked = {(r["images"][0][-5:], r["messages"][0]["content"].split()[2]) for r in absent}
    assert len(asked) == 4 and all(name not in ("cat", "dog") for file, name in asked if file == "a.jpg")
    assert all(parse_items(r["messages"][1]["content"]) == [] for r in absent)
    code, summary, _ = convert(capsys, src, tmp_path / "all.json", "--coco-absent", "all")
    assert code == 0 and summary["coco"]["samples_not_present"] == 3 + 5
    code, _, err = convert(capsys, src, tmp_path / "image.json", "--coco-absent", "1", "--coco-group", "image")
    assert code == 2 and "--coco-group category" in err
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(f"qwenvl_patch: true\nimage_min_pixels: {POLICY.min_pixels}\nimage_max_pixels: "
                         f"{POLICY.max_pixels}\ntemplate: qwen2_vl\ndataset_dir: {tmp_path}\ndataset: out0\n")
    assert main(["check", "--yaml", str(yaml_path)]) == 0, capsys.readouterr().out


def test_images_sharing_an_id_are_error_rows_not_each_others_boxes(tmp_path, capsys):
    """Issue 22, class 7: two images sharing an id got each other's boxes."""
    for name in ("a.jpg", "b.jpg", "c.jpg"):
        save_image(tmp_path / name, 640, 480)
    src = coco_file(tmp_path / "instances.json", [image(1, "a.jpg"), image(1, "b.jpg"), image(2, "c.jpg")],
                    [box(1, 1, 1), box(2, 1, 2), box(3, 2, 3)])
    code, summary, _ = convert(capsys, src, tmp_path / "out.json", "--skip-bad")
    assert code == 0 and summary["written"] == 1 and summary["dropped"] == 2
    rows = error_rows(tmp_path / "out.json")
    assert all("shares id 1" in row["error"] for row in rows)
    assert "(a.jpg)" in rows[0]["error"] and "(b.jpg)" in rows[1]["error"]
    assert records(tmp_path / "out.json")[0]["images"][0].endswith("c.jpg")


@pytest.mark.parametrize("bad, message", [
    ({"images": [image([1], "a.jpg")]}, "an id is an integer or a string; got id"),
    ({"images": [image(1.0, "a.jpg")]}, "an id is an integer or a string; got id"),
    ({"annotations": [box(9, [1])]}, "needs an integer or string 'image_id', got [1]"),
    ({"annotations": [box(9, {"id": 1})]}, "needs an integer or string 'image_id'"),
    ({"annotations": [box(9, 7)]}, "refer to image_id 7, which no image has"),
    ({"annotations": [box(9, "1")]}, "refer to it as image_id '1', a string where its id is a number"),
    ({"annotations": [box(9, 1, 42)]}, "category_id 42, which 'categories' does not declare"),
    ({"annotations": [box(9, 1, [1])]}, "category_id [1], which is not an integer or string"),
    ({"annotations": [box(9, 1, 4)], "categories": CATEGORIES + [{"id": 4}]}, "category 4 has no name"),
    ({"annotations": [box(9, 1, 4)], "categories": CATEGORIES + [{"id": 4, "name": "<image>"}]},
     "which LLaMA-Factory reads as a media tag"),
    ({"annotations": [box(9, 1, 3)], "categories": CATEGORIES + [{"id": 3, "name": "truck"}]},
     "category id 3 is declared twice ('car' and 'truck')"),
])
def test_ids_that_cannot_be_tied_to_a_sample_are_error_rows(tmp_path, capsys, bad, message):
    """Issue 22, class 7: annotations with an unknown or mistyped image_id vanished, a list as an id was a traceback,
    an unknown category id silently became the label "42"."""
    save_image(tmp_path / "a.jpg", 640, 480)
    save_image(tmp_path / "b.jpg", 640, 480)
    images = bad.get("images", [image(1, "a.jpg")]) + [image(2, "b.jpg")]
    src = coco_file(tmp_path / "instances.json", images, [box(1, 2, 1), *bad.get("annotations", [])],
                    bad.get("categories", CATEGORIES))
    code, summary, err = convert(capsys, src, tmp_path / "out.json")
    assert code == 1 and summary["dropped"] == 1, err
    [row] = error_rows(tmp_path / "out.json")
    assert message in row["error"] and row["file"] == str(src)
    assert not (tmp_path / "out.json").exists()
    code, summary, _ = convert(capsys, src, tmp_path / "out.json", "--skip-bad")
    assert code == 0 and [json.loads(r["messages"][1]["content"])[0]["label"] for r in records(tmp_path / "out.json")
                          ] == ["cat"]  # only b.jpg's own box, nowhere a label such as "42"


def exif_rotated(path: Path, width: int = 400, height: int = 200) -> Path:
    picture = Image.new("RGB", (width, height), (200, 30, 30))
    exif = picture.getexif()
    exif[0x0112] = 6  # displayed rotated 90 degrees: height x width
    picture.save(path, exif=exif)
    return path


def test_exif_bake_compares_the_declared_size_with_the_displayed_image(tmp_path, capsys):
    """Issue 22, class 7: with --exif bake the declared size was compared with the stored size, so a COCO file
    written by a tool that shows the rotated photo (200x400) was refused and one declaring the stored size passed."""
    exif_rotated(tmp_path / "phone.jpg")
    displayed = coco_file(tmp_path / "displayed.json", [image(1, "phone.jpg", 200, 400)],
                          [box(1, 1, bbox=(0, 0, 200, 400))])
    stored = coco_file(tmp_path / "stored.json", [image(1, "phone.jpg", 400, 200)], [box(1, 1, bbox=(0, 0, 400, 200))])
    code, summary, err = convert(capsys, displayed, tmp_path / "d.json", "--exif", "bake")
    assert code == 0 and summary["exif_baked"] == 1, err
    h, w = POLICY.model_size(400, 200)
    assert parse_items(records(tmp_path / "d.json")[0]["messages"][1]["content"])[0].coords == (0, 0, w, h)
    code, _, _ = convert(capsys, stored, tmp_path / "s.json", "--exif", "bake")
    [row] = error_rows(tmp_path / "s.json")
    assert code == 1 and "that is the stored size: pass --exif raw" in row["error"]
    code, _, _ = convert(capsys, stored, tmp_path / "r.json", "--exif", "raw")
    assert code == 0
    code, _, _ = convert(capsys, displayed, tmp_path / "x.json", "--exif", "raw")
    [row] = error_rows(tmp_path / "x.json")
    assert code == 1 and "that is the displayed size: pass --exif bake" in row["error"]


@pytest.mark.parametrize("prompt, message", [
    ("Find the {object}.", "the only placeholder is {category}"),
    ("Find the {category", "literal braces"),
    ("<image>Find the {category}.", "must not contain <image>"),
])
def test_a_bad_coco_prompt_is_one_line(tmp_path, capsys, prompt, message):
    save_image(tmp_path / "a.jpg", 640, 480)
    src = coco_file(tmp_path / "instances.json", [image(1, "a.jpg")], [box(1, 1)])
    code, _, err = convert(capsys, src, tmp_path / "out.json", "--coco-prompt", prompt)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("indent", [None, 2], ids=["one-line", "pretty"])
def test_coco_in_its_own_key_order_is_recognised(tmp_path, capsys, indent):
    """COCO's files start with info and licenses, then a long 'images' list: 'annotations' comes long after the
    first 4 kB. The format is read from the top-level keys, streamed, without --format."""
    names = [f"{n:012d}.jpg" for n in range(1, 301)]
    for name in names[:2]:
        save_image(tmp_path / "val2017" / name, 640, 480)
    data = {"info": {"description": "COCO 2017 Dataset", "version": "1.0"},
            "licenses": [{"url": "http://creativecommons.org/licenses/by-nc-sa/2.0/", "id": 1, "name": "by-nc-sa"}],
            "images": [dict(image(n + 1, name), license=1, coco_url="http://images.cocodataset.org/val2017/" + name,
                            date_captured="2013-11-14 17:02:52") for n, name in enumerate(names[:2])]
            + [dict(image(n + 1, name), license=1) for n, name in enumerate(names[2:], start=2)],
            "annotations": [box(1, 1), box(2, 2, 2)], "categories": CATEGORIES}
    src = tmp_path / "annotations" / "instances_val2017.json"
    src.parent.mkdir()
    src.write_text(json.dumps(data, indent=indent))
    assert src.read_bytes().find(b'"annotations"') > 4096
    code, summary, err = convert(capsys, src, tmp_path / "data" / "train.json", "--image-dir", str(tmp_path / "val2017"))
    assert code == 0, err
    assert summary["coco"]["samples_with_boxes"] == 2


@pytest.mark.parametrize("field, value", [("iscrowd", "0"), ("iscrowd", None), ("iscrowd", 2), ("width", "640"),
                                          ("width", 640.5), ("height", None), ("height", 0), ("width", True)])
def test_mistyped_crowd_flags_and_sizes_are_error_rows(tmp_path, capsys, field, value):
    """iscrowd "0" used to count as a crowd region (the sample dropped), and a width that is text skipped the
    declared-size check: each is now an error row naming the image and the field; the other image is converted.
    An image that does not declare its size is fine."""
    for name in ("a.jpg", "b.jpg"):
        save_image(tmp_path / name, 640, 480)
    bad_image, bad_box = image(1, "a.jpg"), box(1, 1)
    (bad_box if field == "iscrowd" else bad_image)[field] = value
    good = {"id": 2, "file_name": "b.jpg"}  # no width or height declared
    src = coco_file(tmp_path / "instances.json", [bad_image, good], [bad_box, box(2, 2)])
    out = tmp_path / "data" / "train.json"
    code, summary, err = convert(capsys, src, out)
    assert code == 1 and summary["dropped"] == 1 and not out.exists(), err
    [row] = error_rows(out)
    assert "a.jpg" in row["error"] and field in row["error"] and row["file"] == str(src), row
    code, summary, err = convert(capsys, src, out, "--skip-bad")
    assert code == 0 and [r["images"][0].endswith("b.jpg") for r in records(out)] == [True], err
