"""The pinned plugins count an image's tokens from its header (what LF's tokenization of a dataset asks for), and the
count is the one the pixels give in the collator: equal grids on odd sizes for both factors, for every input LF
passes (paths, ``file://`` URLs, dicts of a path or bytes, streams, in-memory images); nothing is decoded to count;
and where the processor would resize a frame-sized image again (bounds not the policy's, in ``size`` or in 4.57's
``min_pixels`` / ``max_pixels``; or close bounds whose frame rounds past them) the count comes from the pixels."""

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
FAMILIES = [("tiny_model", "qwen2_vl", 28), ("tiny_model_qwen3", "qwen3_vl_nothink", 32)]


def image_file(path, size, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=90)
    return str(path)


def plugin_and_processor(model, template, factor, processor_policy="pinned", policy=None):
    """The pinned plugin (``policy``, by default 16 to 256 tokens) and the folder's processor, its bounds pinned to
    the policy as a run pins them (``pin_processor``), or to ``processor_policy``, or the folder's own (None)."""
    from llamafactory.data.template import TEMPLATES
    from transformers import AutoProcessor

    from llamafactory_qwenvl_patch.integration.plugin import pinned_plugin

    policy = policy or ResizePolicy(16 * factor * factor, 256 * factor * factor, factor)
    video = VideoPolicy(2048, 12288, factor, 2.0, 16, "seconds" if factor == 28 else "stamps")
    processor = AutoProcessor.from_pretrained(model)
    if processor_policy is not None:
        set_image_processor_bounds(processor.image_processor,
                                   policy if processor_policy == "pinned" else processor_policy)
    return pinned_plugin(TEMPLATES[template].mm_plugin, policy, video, 2.0), processor


def counted_and_made(plugin, processor, images):
    counted = plugin._get_mm_token_metadata(images, [], [], processor)["image_grid_thw"]
    for image in images:
        if isinstance(image, io.IOBase):
            assert not image.closed  # a caller's stream stays open for its pixels
    made = plugin._get_mm_inputs(images, [], [], processor)["image_grid_thw"]
    assert counted.dtype == made.dtype == torch.long and torch.equal(counted, made)
    return made


@pytest.mark.parametrize("fixture, template, factor", FAMILIES)
@pytest.mark.parametrize("bounds", ["pinned", None])
def test_header_counts_equal_the_pixels(tmp_path, request, fixture, template, factor, bounds):
    plugin, processor = plugin_and_processor(request.getfixturevalue(fixture), template, factor, bounds)
    paths = [image_file(tmp_path / f"{i}.jpg", size, i) for i, size in enumerate(SIZES)]
    data = (tmp_path / "0.jpg").read_bytes()
    images = [*paths, f"file://{paths[2]}", {"path": paths[3]}, {"bytes": data, "path": None}, io.BytesIO(data),
              Image.open(paths[1]).convert("RGB")]
    made = counted_and_made(plugin, processor, images)
    messages = [{"role": "user", "content": "<image>" * len(images) + "where?"}]
    for image in images:
        if isinstance(image, io.IOBase):
            image.seek(0)
    expanded = plugin.process_messages(messages, images, [], [], processor)[0]["content"]
    merge = processor.image_processor.merge_size ** 2
    assert expanded.count(plugin.image_token) == int(made.prod(dim=1).sum()) // merge


@pytest.mark.parametrize("fixture, template, factor", FAMILIES)
def test_nothing_is_decoded_to_count(tmp_path, request, fixture, template, factor):
    """A file whose header is whole and whose pixels are cut is counted from the header; its pixels still fail,
    naming it, where the collator makes them, and where the processor's bounds are the folder's own."""
    model = request.getfixturevalue(fixture)
    plugin, processor = plugin_and_processor(model, template, factor)
    image_file(tmp_path / "whole.jpg", (1170, 2532))
    whole = (tmp_path / "whole.jpg").read_bytes()
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(whole[:len(whole) // 3])
    grid = plugin._get_mm_token_metadata([str(cut)], [], [], processor)["image_grid_thw"]
    patch = factor // 2
    assert grid.tolist() == [[1, *(side // patch for side in plugin.policy.model_size(2532, 1170))]]
    with pytest.raises(ImageError, match="cut.jpg"):
        plugin._get_mm_inputs([str(cut)], [], [], processor)
    unpinned, processor = plugin_and_processor(model, template, factor, None)
    with pytest.raises(ImageError, match="cut.jpg"):
        unpinned._get_mm_token_metadata([str(cut)], [], [], processor)


def test_a_processor_that_would_resize_is_asked_with_pixels(tmp_path, tiny_model):
    """Bounds narrower than the policy's: the processor shrinks the frame-sized image, and the count follows it."""
    plugin, processor = plugin_and_processor(tiny_model, "qwen2_vl", 28, ResizePolicy(4 * 28 * 28, 32 * 28 * 28, 28))
    made = counted_and_made(plugin, processor, [image_file(tmp_path / "big.jpg", (3840, 2160))])
    assert int(made.prod()) <= 32 * 4


def test_close_bounds_whose_frame_the_processor_resizes_again(tmp_path, tiny_model):
    """min = max (the fields demo's first curriculum stage): ``smart_resize`` rounds most frames past the bounds, and
    the processor, pinned to the same bounds, resizes them again; their counts are the pixels'."""
    policy = ResizePolicy(16 * 28 * 28, 16 * 28 * 28, 28)
    plugin, processor = plugin_and_processor(tiny_model, "qwen2_vl", 28, policy=policy)
    paths = [image_file(tmp_path / f"{i}.png", size, i) for i, size in enumerate(SIZES[:3] + [(700, 500)])]
    made = counted_and_made(plugin, processor, paths)
    frames = [policy.model_size(*reversed(Image.open(path).size)) for path in paths]
    assert any(list(row[1:]) != [h // 14, w // 14] for row, (h, w) in zip(made.tolist(), frames))


def test_bounds_set_only_where_4_57_resizes_are_asked_with_pixels(tmp_path, tiny_model):
    """transformers 4.57's processors resize with their ``min_pixels`` / ``max_pixels`` attributes, which their
    ``size`` need not say: a processor whose ``size`` is the policy's but whose attributes are narrower resizes."""
    plugin, processor = plugin_and_processor(tiny_model, "qwen2_vl", 28)
    image_processor = processor.image_processor
    if getattr(image_processor, "max_pixels", None) is None:
        pytest.skip("this transformers' processors resize with their size only")
    image_processor.min_pixels, image_processor.max_pixels = 4 * 28 * 28, 32 * 28 * 28
    made = counted_and_made(plugin, processor, [image_file(tmp_path / "big.jpg", (3840, 2160))])
    assert int(made.prod()) <= 32 * 4
