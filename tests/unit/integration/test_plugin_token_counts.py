"""The pinned plugins count an image's tokens from its header (what LF's tokenization of a dataset asks for), and the
count is the one the pixels give in the collator: equal grids on odd sizes for both factors, for paths, bytes and
in-memory images; nothing is decoded to count; and a processor whose bounds are not the policy's (it would resize a
frame-sized image) is asked with pixels, as before."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import set_image_processor_bounds
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.image_io.images import ImageError

SIZES = [(1170, 2532), (3840, 2160), (800, 1280), (2000, 11), (37, 29), (641, 479)]  # (width, height)


def image_file(path, size, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=90)
    return str(path)


def plugin_and_processor(model, template, factor, processor_policy="pinned"):
    """The pinned plugin and the folder's processor, its bounds pinned to the policy as a run pins them
    (``pin_processor``), or to ``processor_policy``, or left as the folder has them (None)."""
    from llamafactory.data.template import TEMPLATES
    from transformers import AutoProcessor

    from llamafactory_qwenvl_patch.integration.plugin import pinned_plugin

    policy = ResizePolicy(16 * factor * factor, 256 * factor * factor, factor)
    video = VideoPolicy(2048, 12288, factor, 2.0, 16, "seconds" if factor == 28 else "stamps")
    processor = AutoProcessor.from_pretrained(model)
    if processor_policy is not None:
        set_image_processor_bounds(processor.image_processor,
                                   policy if processor_policy == "pinned" else processor_policy)
    return pinned_plugin(TEMPLATES[template].mm_plugin, policy, video, 2.0), processor


@pytest.mark.parametrize("fixture, template, factor", [("tiny_model", "qwen2_vl", 28),
                                                       ("tiny_model_qwen3", "qwen3_vl_nothink", 32)])
@pytest.mark.parametrize("bounds", ["pinned", None])
def test_header_counts_equal_the_pixels(tmp_path, request, fixture, template, factor, bounds):
    plugin, processor = plugin_and_processor(request.getfixturevalue(fixture), template, factor, bounds)
    paths = [image_file(tmp_path / f"{i}.jpg", size, i) for i, size in enumerate(SIZES)]
    images = [*paths, {"bytes": open(paths[0], "rb").read(), "path": None}, Image.open(paths[1]).convert("RGB")]
    counted = plugin._get_mm_token_metadata(images, [], [], processor)["image_grid_thw"]
    made = plugin._get_mm_inputs(images, [], [], processor)["image_grid_thw"]
    assert counted.dtype == made.dtype == torch.long and torch.equal(counted, made)
    messages = [{"role": "user", "content": "<image>" * len(images) + "where?"}]
    expanded = plugin.process_messages(messages, images, [], [], processor)[0]["content"]
    merge = processor.image_processor.merge_size ** 2
    assert expanded.count(plugin.image_token) == int(made.prod(dim=1).sum()) // merge


def test_nothing_is_decoded_to_count(tmp_path, tiny_model):
    """A file whose header is whole and whose pixels are cut is counted from the header; its pixels still fail,
    naming it, where the collator makes them, and where the processor's bounds are the folder's own."""
    plugin, processor = plugin_and_processor(tiny_model, "qwen2_vl", 28)
    whole = open(image_file(tmp_path / "whole.jpg", (1170, 2532)), "rb").read()
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(whole[:len(whole) // 3])
    grid = plugin._get_mm_token_metadata([str(cut)], [], [], processor)["image_grid_thw"]
    assert grid.tolist() == [[1, *(side // 14 for side in plugin.policy.model_size(2532, 1170))]]
    with pytest.raises(ImageError, match="cut.jpg"):
        plugin._get_mm_inputs([str(cut)], [], [], processor)
    unpinned, processor = plugin_and_processor(tiny_model, "qwen2_vl", 28, None)
    with pytest.raises(ImageError, match="cut.jpg"):
        unpinned._get_mm_token_metadata([str(cut)], [], [], processor)


def test_a_processor_that_would_resize_is_asked_with_pixels(tmp_path, tiny_model):
    """Bounds narrower than the policy's: the processor shrinks the frame-sized image, and the count follows it."""
    plugin, processor = plugin_and_processor(tiny_model, "qwen2_vl", 28, ResizePolicy(4 * 28 * 28, 32 * 28 * 28, 28))
    path = image_file(tmp_path / "big.jpg", (3840, 2160))
    counted = plugin._get_mm_token_metadata([path], [], [], processor)["image_grid_thw"]
    made = plugin._get_mm_inputs([path], [], [], processor)["image_grid_thw"]
    assert torch.equal(counted, made) and int(made.prod()) <= 32 * 4
