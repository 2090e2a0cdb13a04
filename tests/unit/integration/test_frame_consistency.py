"""Through LF's real get_dataset and collator: the grid the model gets equals the policy's frame (and stock LF's isn't)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import grounding_record, lf_sft_dataset, save_image, write_sharegpt

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from qwenvl_prep.lf.drift import stock_llamafactory_size

pytestmark = pytest.mark.slow  # LF's dataset pipeline and model, about two minutes

MIN_PIXELS, MAX_PIXELS = 256 * 28 * 28, 1024 * 28 * 28


def image_sizes() -> list[tuple[int, int]]:
    """(width, height): COCO-like, phone, screenshot, scan, random 28..5000, extreme aspect ratios. 120 in all: each
    image is decoded and resized twice a test (LF's dataset map and its collator), where this file's time goes (230
    sizes took 92 s on 2 cores); the frame math alone is checked on many more sizes (tests/unit/frame, hypothesis)."""
    rng = random.Random(1234)
    sizes = [(640, 480), (640, 427), (500, 375), (427, 640), (640, 640), (612, 612), (480, 640), (640, 360)]
    sizes += [(4032, 3024), (3024, 4032), (4000, 3000), (1920, 1080), (1080, 1920), (2560, 1440), (1170, 2532)]
    sizes += [(2480, 3508), (3508, 2480), (1700, 2200), (2550, 3300)]
    sizes += [(3000, 28), (28, 3000), (5000, 40), (40, 5000), (2800, 16), (20, 20), (28, 28), (13, 2500), (29, 5600)]
    while len(sizes) < 120:
        sizes.append((rng.randint(28, 5000), rng.randint(28, 5000)))
    return sizes


def collate_grids(model_dir: Path, data_dir: Path, tmp_path: Path, patch: bool, template: str = "qwen2_vl"):
    """Run LF's own pipeline in-process: load_tokenizer -> template -> get_dataset -> collator."""
    from llamafactory.data import MultiModalDataCollatorForSeq2Seq

    tokenizer_module, tmpl, dataset = lf_sft_dataset(
        model_dir, data_dir, tmp_path / f"out-{patch}", qwenvl_patch=patch, image_min_pixels=MIN_PIXELS,
        image_max_pixels=MAX_PIXELS, cutoff_len=8192, template=template,
    )
    tokenizer = tokenizer_module["tokenizer"]
    collator = MultiModalDataCollatorForSeq2Seq(template=tmpl, pad_to_multiple_of=8, **tokenizer_module)
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grids, pads = [], []
    for index in range(len(dataset)):
        batch = collator([dataset[index]])
        grids.append(batch["image_grid_thw"][0].tolist())
        pads.append(int((batch["input_ids"] == image_pad).sum()))
    return grids, pads


@pytest.fixture(scope="module")
def size_dataset(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("sizes")
    sizes = image_sizes()
    records = [grounding_record(save_image(data_dir / f"img{i}.jpg", w, h)) for i, (w, h) in enumerate(sizes)]
    write_sharegpt(data_dir, "toy", records)
    return data_dir, sizes


def test_model_frame_equals_policy_frame(tiny_model, size_dataset, tmp_path):
    data_dir, sizes = size_dataset
    policy = ResizePolicy(MIN_PIXELS, MAX_PIXELS, 28)
    grids, pads = collate_grids(tiny_model, data_dir, tmp_path, patch=True)
    assert len(grids) == len(sizes) >= 120
    for (width, height), grid, pad in zip(sizes, grids, pads):
        expected = policy.model_size(height, width)
        assert (grid[1] * 14, grid[2] * 14) == expected, (width, height)
        assert pad == policy.image_tokens(height, width) == grid[1] * grid[2] // 4


def test_stock_llamafactory_disagrees(tiny_model, size_dataset, tmp_path):
    """Documents the bug: without the plugin, LF's frame differs from smart_resize labels for many images."""
    data_dir, sizes = size_dataset
    policy = ResizePolicy(MIN_PIXELS, MAX_PIXELS, 28)
    grids, _ = collate_grids(tiny_model, data_dir, tmp_path, patch=False)
    from transformers import AutoProcessor

    ip = AutoProcessor.from_pretrained(tiny_model).image_processor
    stock = [(g[1] * 14, g[2] * 14) for g in grids]
    mismatched = [s for s, frame in zip(sizes, stock) if frame != policy.model_size(s[1], s[0])]
    assert len(mismatched) / len(sizes) > 0.3
    assert (4032, 3024) in mismatched
    # The policy core's model of stock LF (used by the drift audit) reproduces the real stock pipeline exactly.
    for (width, height), frame in zip(sizes, stock):
        assert frame == stock_llamafactory_size(
            height, width, MIN_PIXELS, MAX_PIXELS, ip.size["shortest_edge"], ip.size["longest_edge"]
        ), (width, height)


def test_qwen3_vl_uses_factor_32(tiny_model_qwen3, tmp_path):
    data_dir = tmp_path / "data"
    sizes = [(4032, 3024), (1920, 1080), (333, 777), (40, 3000)]
    write_sharegpt(data_dir, "toy", [grounding_record(save_image(data_dir / f"q{i}.jpg", *s)) for i, s in enumerate(sizes)])
    policy = ResizePolicy(MIN_PIXELS, MAX_PIXELS, 32)
    grids, pads = collate_grids(tiny_model_qwen3, data_dir, tmp_path, patch=True, template="qwen3_vl_nothink")
    for (width, height), grid, pad in zip(sizes, grids, pads):
        assert (grid[1] * 16, grid[2] * 16) == policy.model_size(height, width)
        assert pad == policy.image_tokens(height, width)
    assert torch.tensor(pads).sum() > 0
