"""Issue 22, item 4: no command writes onto one of its inputs, onto a file a registry entry uses, through a symlink it
did not create, or outside its output folder; each is refused before anything is written, naming the path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import save_image

from qwenvl_prep.cli import main

MIN, MAX = 64 * 28 * 28, 256 * 28 * 28
FLAGS = ["--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]
RECORD = {"image": "photo.png", "question": "Find it.", "answer": '[{"bbox_2d": [1, 2, 30, 40]}]'}


@pytest.fixture()
def converted(tmp_path, capsys) -> dict[str, Path]:
    """A converted dataset (registered as 'train'), its image, its registry and predictions for it."""
    save_image(tmp_path / "photo.png", 640, 480)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(RECORD) + "\n")
    data = tmp_path / "data"
    assert main(["convert", str(src), "-o", str(data / "train.jsonl"), "--input-coords", "abs", *FLAGS]) == 0
    label = json.loads((data / "train.jsonl").read_text())["messages"][1]["content"]
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text(json.dumps({"predict": label, "label": label}) + "\n")
    capsys.readouterr()
    return {"input": src, "dataset": data / "train.jsonl", "image": tmp_path / "photo.png",
            "registry": data / "dataset_info.json", "predictions": predictions, "data": data}


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path below ``root`` with its bytes (a link as its target)."""
    return {str(p.relative_to(root)): (f"-> {p.readlink()}" if p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}


def refused(capsys, args: list[str], *expected: str) -> None:
    assert main([str(a) for a in args]) == 2, args
    err = capsys.readouterr().err
    assert all(text in err for text in expected) and "Traceback" not in err, (args, err)


def test_eval_never_writes_onto_its_inputs_or_the_registry(tmp_path, converted, capsys):
    """Was: `eval --json-out` / `--plot` replaced the dataset, the predictions, dataset_info.json or an image."""
    before = snapshot(tmp_path)
    base = ["eval", converted["dataset"], "--predictions", converted["predictions"]]
    for flag in ("--json-out", "--plot"):
        for name in ("dataset", "predictions", "registry", "image"):
            refused(capsys, [*base, flag, converted[name]], flag, str(converted[name]))
    assert snapshot(tmp_path) == before
    assert main([*map(str, base), "--json-out", str(tmp_path / "eval.json")]) == 0  # an ordinary output still works


def test_convert_refuses_links_and_files_other_entries_use(tmp_path, converted, capsys):
    """Was: `-o` given a symlink wrote through to its target (an image became JSON); following convert's own advice
    (`--dataset-name other`) overwrote the file of entry 'train'; `--errors` could name another entry's file."""
    data = converted["data"]
    (data / "link.jsonl").symlink_to(converted["image"])
    (data / "other.jsonl").write_text("{}\n")
    info = json.loads(converted["registry"].read_text())
    converted["registry"].write_text(json.dumps({**info, "other": {"file_name": "other.jsonl"}}))
    before = snapshot(tmp_path)
    base = ["convert", converted["input"], "--input-coords", "abs", *FLAGS]
    refused(capsys, [*base, "-o", data / "link.jsonl"], "is a symbolic link", "link.jsonl")
    refused(capsys, [*base, "-o", data / "train.jsonl"], "already has a dataset named 'train'")
    for extra in ([], ["--overwrite"]):
        refused(capsys, [*base, "-o", data / "train.jsonl", "--dataset-name", "second", *extra],
                "is the file of dataset 'train'")
    refused(capsys, [*base, "-o", data / "new.jsonl", "--errors", data / "other.jsonl"],
            "--errors", "is the file of dataset 'other'")
    assert snapshot(tmp_path) == before


def test_curriculum_stays_inside_its_folder(tmp_path, converted, capsys):
    """Was: `--dataset-name ../../x` wrote datasets outside -o and left the stage YAMLs pointing at nothing; a base
    YAML inside -o could be replaced by a stage YAML."""
    base_yaml = tmp_path / "cur" / "stage1.yaml"
    base_yaml.parent.mkdir()
    base_yaml.write_text(f"qwenvl_patch: true\nimage_min_pixels: {MIN}\nimage_max_pixels: {MAX}\n"
                         "template: qwen2_vl\nfinetuning_type: lora\n")
    before = snapshot(tmp_path)
    args = ["curriculum", converted["input"], "--from-yaml", base_yaml, "--stages", f"{MIN},{MAX}",
            "--input-coords", "abs", "-q", "--workers", "1"]
    refused(capsys, [*args, "-o", tmp_path / "cur", "--dataset-name", "../../x"], "--dataset-name", "../../x")
    refused(capsys, [*args, "-o", tmp_path / "cur", "--overwrite"], "stage YAML", "an input of this run")
    refused(capsys, [*args, "-o", converted["input"]], "is a file")
    assert snapshot(tmp_path) == before


def test_predict_and_draw_refuse_before_writing(tmp_path, converted, capsys):
    """predict -o onto its dataset or into its model folder, and a draw output that is a planted symlink."""
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "drawn"
    out.mkdir()
    (out / "train-000000-original.jpg").symlink_to(converted["image"])
    before = snapshot(tmp_path)
    refused(capsys, ["predict", model, "--dataset", converted["dataset"], "-o", converted["dataset"]],
            "-o", "an input of this run")
    refused(capsys, ["predict", model, "--dataset", converted["dataset"], "-o", model / "answers.jsonl"],
            "inside an input of this run")
    refused(capsys, ["draw", converted["dataset"], "-o", out, "--sample", "0"], "is a symbolic link")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["../../x", "a,b", ".hidden", "tab\there", " padded"])
def test_convert_refuses_a_dataset_name_lf_cannot_use(tmp_path, converted, capsys, name):
    """Issue 33, class 10: `convert --dataset-name ../../x` registered the name as given; LF splits `dataset:` at
    commas, and a name is not a path. Refused before anything is written."""
    before = snapshot(tmp_path)
    refused(capsys, ["convert", converted["input"], "-o", converted["data"] / "other.jsonl", "--input-coords", "abs",
                     *FLAGS, "--dataset-name", name], "--dataset-name", repr(name))
    assert snapshot(tmp_path) == before
