"""Hostile input for the image readers (issue 11): paths that are not regular files (a FIFO, a directory) are
named errors in every reader and an error row in convert, never a hang; 16-bit grey PNGs are scaled, not clipped."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from helpers import BIN, save_image, write_clip
from hostile import POLICY

from llamafactory_qwenvl_patch.image_io.images import ImageError, model_input_image, open_image
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.integration.preflight import check_image
from qwenvl_prep.plumbing.imageinfo import read_info


def within(seconds: float, func, *args):
    """Run ``func`` in a daemon thread: a hang fails the test instead of stalling the suite."""
    result: dict = {}

    def target():
        try:
            result["value"] = func(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{func.__name__} hung on its input"
    if "error" in result:
        raise result["error"]
    return result.get("value")


@pytest.fixture()
def odd_paths(tmp_path) -> dict[str, Path]:
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.jpg"
    folder.mkdir()
    return {"a FIFO": fifo, "a directory": folder}


@pytest.mark.parametrize("reader", [open_image, read_info, lambda p: check_image(str(p), POLICY),
                                    lambda p: model_input_image(str(p), POLICY)])
def test_non_regular_files_are_named_errors(odd_paths, reader):
    for kind, path in odd_paths.items():
        with pytest.raises(ImageError, match=f"{path.name}: is {kind}, not a regular file"):
            within(20, reader, path if reader is read_info else str(path))


def test_convert_reports_a_fifo_record_instead_of_hanging(tmp_path, odd_paths):
    save_image(tmp_path / "ok.jpg", 640, 480)
    records = [{"image": "ok.jpg", "question": "Find it.", "answer": '[{"bbox_2d": [1, 2, 30, 40]}]'},
               {"image": "pipe.jpg", "question": "Find it.", "answer": '[{"bbox_2d": [1, 2, 30, 40]}]'},
               {"image": "folder.jpg", "question": "Find it.", "answer": '[{"bbox_2d": [1, 2, 30, 40]}]'}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out" / "train.json"
    result = subprocess.run([str(BIN / "qwenvl-prep"), "convert", str(src), "-o", str(out), "--input-coords", "abs",
                             "--min-pixels", str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels), "-q"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    rows = [json.loads(line) for line in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    assert [(row["record"], "FIFO" in row["error"], "directory" in row["error"]) for row in rows] == \
        [(1, True, False), (2, False, True)]  # records counted from 0, as in every errors file
    assert not out.exists()


def test_sixteen_bit_grey_pngs_are_scaled_not_clipped(tmp_path):
    import numpy as np
    from PIL import Image

    values = (np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16)  # 0 .. 65520
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    image = model_input_image(str(path), ResizePolicy(56 * 56, 64 * 64 * 4))
    pixels = np.asarray(image.convert("L"), dtype=np.float64)
    assert image.mode == "RGB" and 100 < pixels.mean() < 155  # clipping gave a mean near 255


def test_a_clip_is_named_a_video(tmp_path, monkeypatch):
    """Issue 51: a clip's frame size over PIL's limit read "image video X: refused as a decompression bomb"; a FIFO
    clip, "only regular image files are read"."""
    from PIL import Image

    from llamafactory_qwenvl_patch.image_io.video import probe

    os.mkfifo(tmp_path / "fifo.mp4")
    with pytest.raises(ImageError, match=r"^video .*fifo\.mp4: is a FIFO, .*only regular video files are read"):
        within(10, probe, str(tmp_path / "fifo.mp4"), 2.0)
    clip = write_clip(tmp_path / "big.mp4", 1, 4, 160, 96)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 160x96 is over twice this limit
    with pytest.raises(ImageError, match=r"^video .*big\.mp4: refused as a decompression bomb \(160x96"):
        probe(str(clip), 2.0)
