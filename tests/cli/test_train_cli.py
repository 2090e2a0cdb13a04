"""``llamafactory-cli train`` in a subprocess on the tiny model, with ``qwenvl_patch: true``."""

from __future__ import annotations

import json

import pytest
from helpers import (
    cut_file, grounding_record, read_log, run_cli, save_image, torchrun_env, train_config, write_clip, write_sharegpt,
)

# Phone photos and screenshots: every one of these gets a different frame from stock LF.
MISMATCHED_SIZES = [(4032, 3024), (3024, 4032), (1170, 2532), (1920, 1080)]


@pytest.fixture()
def phone_data(tmp_path):
    data_dir = tmp_path / "data"
    records = [grounding_record(save_image(data_dir / f"p{i}.jpg", w, h)) for i, (w, h) in enumerate(MISMATCHED_SIZES)]
    write_sharegpt(data_dir, "toy", records)
    return data_dir


def assert_pinned(folder, config):
    size = json.loads((folder / "preprocessor_config.json").read_text())["size"]
    assert size == {"shortest_edge": config["image_min_pixels"], "longest_edge": config["image_max_pixels"]}
    record = json.loads((folder / "qwenvl_policy.json").read_text())
    assert (record["min_pixels"], record["max_pixels"], record["factor"]) == (
        config["image_min_pixels"], config["image_max_pixels"], 28)


@pytest.mark.slow
def test_sft_lora_two_steps(tiny_model, phone_data, tmp_path):
    config = train_config(tiny_model, phone_data, tmp_path / "out")
    result = run_cli(["llamafactory-cli", "train"], config, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [entry["loss"] for entry in read_log(tmp_path / "out") if "loss" in entry]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert_pinned(tmp_path / "out" / "checkpoint-2", config)
    assert_pinned(tmp_path / "out", config)
    assert "qwenvl_patch active (rank 0)" in result.stdout + result.stderr


@pytest.mark.slow
def test_torchrun_two_ranks_each_patched(tiny_model, phone_data, tmp_path):
    """Every rank collates its own images; an unpatched rank would crash on mismatched image features."""
    config = train_config(tiny_model, phone_data, tmp_path / "out", ddp_backend="gloo")
    result = run_cli(["llamafactory-cli", "train"], config, tmp_path,
                     env=torchrun_env())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "qwenvl_patch active (rank 0)" in output and "qwenvl_patch active (rank 1)" in output
    assert_pinned(tmp_path / "out" / "checkpoint-2", config)


@pytest.mark.slow
def test_bad_images_and_clips_named_up_front(tiny_model, tmp_path):
    """Every bad image and clip in one list before the model loads (issue 51, class 2: a 0-byte clip stopped at LF's
    datasets.map traceback, one clip per attempt)."""
    data_dir = tmp_path / "data"
    good = save_image(data_dir / "good.jpg", 640, 480)
    truncated = data_dir / "truncated.jpg"
    truncated.write_bytes(save_image(data_dir / "full.jpg", 1024, 768, (10, 200, 30)).read_bytes()[:900])
    too_thin = save_image(data_dir / "thin.png", 4020, 20)
    missing = data_dir / "missing.jpg"
    empty_clip = data_dir / "empty.mp4"
    empty_clip.write_bytes(b"")
    cut_clip = cut_file(write_clip(tmp_path / "whole.mp4", 2, 10, 96, 64, options={"movflags": "faststart"}),
                        data_dir / "cut.mp4")
    answer = {"role": "assistant", "content": '{"span": [0.5, 1.5]}'}
    clips = [{"messages": [{"role": "user", "content": "<video>When?"}, answer], "videos": [clip.name]}
             for clip in (empty_clip, cut_clip)]
    records = [grounding_record(p) for p in (good, missing, truncated, too_thin)] + clips
    write_sharegpt(data_dir, "toy", records, {"messages": "messages", "images": "images", "videos": "videos"})
    before = (data_dir / "toy.json").read_text()
    result = run_cli(["llamafactory-cli", "train"], train_config(tiny_model, data_dir, tmp_path / "out"), tmp_path)
    assert result.returncode != 0
    message = result.stderr[result.stderr.rindex("DatasetMediaError"):]
    assert "3 image problem(s) and 2 video problem(s)" in message
    assert "sample 1 " in message and f"{missing}: file not found" in message
    assert "sample 2 " in message and f"{truncated}: the JPEG data is truncated or corrupt" in message
    assert "sample 3 " in message and f"{too_thin}: image size 4020x20 (WxH) has aspect ratio 201.0" in message
    assert "sample 4 " in message and f"{empty_clip}: is empty (0 bytes)" in message
    assert "sample 5 " in message and f"{cut_clip}: is truncated or corrupt" in message
    assert "sample 0 " not in message
    assert "trainable params" not in result.stdout + result.stderr  # the model never loaded
    assert (data_dir / "toy.json").read_text() == before

