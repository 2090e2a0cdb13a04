"""convert's output through LF's real get_dataset with the plugin on, and the training-time stamp guard."""

from __future__ import annotations

import json

import pytest
from helpers import lf_sft_dataset, save_image

from llamafactory_qwenvl_patch.integration.data_patch import StampMismatchError
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from qwenvl_prep.cli import main

MIN, MAX = 128 * 28 * 28, 512 * 28 * 28


def load(tiny_model, data_dir, tmp_path, **overrides):
    settings = dict(image_min_pixels=MIN, image_max_pixels=MAX, dataset="grounding")
    module, _, dataset = lf_sft_dataset(tiny_model, data_dir, tmp_path / "out", **{**settings, **overrides})
    return module, dataset


@pytest.fixture()
def converted(tmp_path):
    save_image(tmp_path / "raw" / "photo.jpg", 4032, 3024)
    src = tmp_path / "raw" / "labels.jsonl"
    src.write_text(json.dumps({"image": "photo.jpg", "question": "Where is the dog?",
                               "answer": '[{"bbox_2d": [1008, 756, 3024, 2268], "label": "dog"}]'}) + "\n")
    data_dir = tmp_path / "data"
    assert main(["convert", str(src), "-o", str(data_dir / "grounding.json"), "--input-coords", "abs",
                 "--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]) == 0
    return data_dir


def test_labels_reaching_the_model_are_in_its_frame(tiny_model, converted, tmp_path):
    module, dataset = load(tiny_model, converted, tmp_path)
    tokenizer = module["tokenizer"]
    labels = [t for t in dataset[0]["labels"] if t >= 0]
    h, w = ResizePolicy(MIN, MAX).model_size(3024, 4032)
    expected = [round(1008 * w / 4032), round(756 * h / 3024), round(3024 * w / 4032), round(2268 * h / 3024)]
    assert tokenizer.decode(labels).startswith(f'[{{"bbox_2d": {expected}, "label": "dog"}}]')
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert dataset[0]["input_ids"].count(image_pad) == (h // 28) * (w // 28)


def test_guard_refuses_a_mismatched_stamp(tiny_model, tiny_model_qwen3, converted, tmp_path):
    with pytest.raises(StampMismatchError) as info:
        load(tiny_model, converted, tmp_path, image_max_pixels=MAX * 2)
    message = str(info.value)
    assert "'grounding'" in message and f"max_pixels: dataset {MAX} vs run {MAX * 2}" in message
    with pytest.raises(StampMismatchError, match="coords: dataset model vs run rel1000 \\(model family qwen3_vl\\)"):
        load(tiny_model_qwen3, converted, tmp_path, template="qwen3_vl_nothink")


def test_guard_warns_on_unstamped(tiny_model, converted, tmp_path, caplog):
    info_path = converted / "dataset_info.json"
    info = json.loads(info_path.read_text())
    del info["grounding"]["qwenvl_policy"]
    info_path.write_text(json.dumps(info))
    import logging

    logging.getLogger("llamafactory").propagate = True
    with caplog.at_level(logging.WARNING):
        load(tiny_model, converted, tmp_path)
    assert "has no qwenvl_policy stamp" in caplog.text
