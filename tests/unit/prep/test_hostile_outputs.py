"""Hostile input for where qwenvl-prep writes (issue 11, class 4): the dataset registry (concurrent merges, a broken
one, links and modes, nothing registered for an empty input), outputs that would clobber inputs, and draw's folder."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from helpers import save_image
from hostile import POLICY, RECORD


def test_concurrent_registrations_keep_every_entry(tmp_path):
    """Parallel shard converts into one folder each merge their entry into dataset_info.json: none may be lost
    (read-modify-rename without a lock dropped entries)."""
    from qwenvl_prep.pipeline.dataset_info import merge_dataset_info

    def register(worker: int) -> None:
        for i in range(25):
            merge_dataset_info(tmp_path, f"shard-{worker}-{i}", {"file_name": f"{worker}-{i}.json"})

    threads = [threading.Thread(target=register, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    assert len(info) == 8 * 25


@pytest.mark.parametrize("registry", ["[]", "null", "{", '"text"'])
def test_broken_registry_is_reported_before_anything_is_written(tmp_path, registry):
    from qwenvl_prep.cli import main

    save_image(tmp_path / "ok.jpg", 640, 480)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"image": "ok.jpg", "question": "Find it.", "answer": '[{"bbox_2d": [1, 2, 30, 40]}]'})
                   + "\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(registry)
    code = main(["convert", str(src), "-o", str(data / "train.json"), "--input-coords", "abs", "-q",
                 "--min-pixels", str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels)])
    assert code == 2
    assert sorted(p.name for p in data.iterdir()) == ["dataset_info.json"]  # no output renamed into place
    assert (data / "dataset_info.json").read_text() == registry


def test_outputs_never_clobber_inputs_the_registry_or_each_other(tmp_path, capsys):
    """Class 4: `-o data/dataset_info.json` replaced the registry; --errors pointing at the input, an image or -o
    overwrote it."""
    from qwenvl_prep.cli import main

    save_image(tmp_path / "ok.jpg", 640, 480)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(RECORD) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text("{}")
    before = {p: p.read_bytes() for p in (src, tmp_path / "ok.jpg", data / "dataset_info.json")}
    flags = ["--input-coords", "abs", "-q", "--min-pixels", str(POLICY.min_pixels), "--max-pixels",
             str(POLICY.max_pixels)]
    cases = [(["-o", str(data / "dataset_info.json")], "would replace the dataset registry"),
             (["-o", str(data / "t.json"), "--errors", str(src)], "is the input"),
             (["-o", str(data / "t.json"), "--errors", str(tmp_path / "ok.jpg")], "must end in .jsonl"),
             (["-o", str(data / "t.jsonl"), "--errors", str(data / "t.jsonl")], "is the output"),
             (["-o", str(data)], "must end in .json"),
             (["-o", str(data / "sub.json")], None)]
    (data / "sub.json").mkdir()
    for args, message in cases:
        assert main(["convert", str(src), *args, *flags]) == 2, args
        err = capsys.readouterr().err
        assert message is None and "is a directory" in err or message in err, (args, err)
    assert all(path.read_bytes() == content for path, content in before.items())


def test_registry_entries_links_and_modes_are_respected(tmp_path, capsys):
    """Class 4: an existing entry is replaced only with --overwrite; a symlinked registry stays a link (written
    through); a read-only registry is refused and left as it is."""
    from qwenvl_prep.cli import main

    save_image(tmp_path / "ok.jpg", 640, 480)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(RECORD) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    shared = tmp_path / "shared_info.json"
    shared.write_text('{"other": {"file_name": "other.json"}}')
    os.chmod(shared, 0o664)
    (data / "dataset_info.json").symlink_to(shared)
    args = ["convert", str(src), "-o", str(data / "train.json"), "--input-coords", "abs", "-q", "--min-pixels",
            str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels)]
    assert main(args) == 0
    assert (data / "dataset_info.json").is_symlink() and set(json.loads(shared.read_text())) == {"other", "train"}
    assert os.stat(shared).st_mode & 0o777 == 0o664
    capsys.readouterr()
    assert main(args) == 2 and "pass --overwrite to replace it" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    capsys.readouterr()
    os.chmod(shared, 0o444)
    try:
        content = shared.read_text()
        assert main([*args, "--overwrite", "--dataset-name", "third"]) == 2
        assert "is read-only" in capsys.readouterr().err and shared.read_text() == content
    finally:
        os.chmod(shared, 0o644)


def test_draw_never_writes_outside_its_folder(tmp_path):
    from llamafactory_qwenvl_patch.frame.stamp import Stamp
    from qwenvl_prep.formats.converted import DatasetRef
    from qwenvl_prep.pipeline.draw import draw

    save_image(tmp_path / "ok.jpg", 640, 480)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"messages": [{"role": "user", "content": "<image>Q"},
                                              {"role": "assistant", "content": '[{"bbox_2d": [1, 2, 30, 40]}]'}],
                                 "images": ["ok.jpg"]}]))
    ref = DatasetRef("../../escape", data, tmp_path, None)
    out = tmp_path / "a" / "b" / "drawn"
    result = draw(ref, Stamp(POLICY, "model", "qwen2_5_vl"), out, sample=0)
    assert all(Path(p).resolve().parent == out.resolve() for p in [*result["images"], result["contact_sheet"]])
    assert sorted(p.name for p in out.iterdir()) == ["escape-000000-original.jpg", "escape-contact-sheet-original.jpg"]


@pytest.mark.parametrize("content", ["", "\n\n", '{"images": [], "annotations": [], "categories": []}'])
def test_an_empty_input_registers_nothing(tmp_path, capsys, content):
    from qwenvl_prep.cli import main

    src = tmp_path / ("in.json" if content.startswith("{") else "in.jsonl")
    src.write_text(content)
    data = tmp_path / "data"
    code = main(["convert", str(src), "-o", str(data / "t.json"), "--min-pixels", str(POLICY.min_pixels),
                 "--max-pixels", str(POLICY.max_pixels), "-q", "--workers", "1", "--format",
                 "coco" if content.startswith("{") else "sharegpt"])
    assert code == 2 and "no records to write" in capsys.readouterr().err
    assert not (data / "t.json").exists() and not (data / "dataset_info.json").exists()
