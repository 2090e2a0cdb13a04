"""The resize policy core: worked example, limits and property tests."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from llamafactory_qwenvl_patch.frame.policy import (
    PolicyError,
    ResizePolicy,
    check_box,
    convert_coords,
    map_coords,
    retarget_coords,
)

POLICY = ResizePolicy(512 * 28 * 28, 1024 * 28 * 28, 28)


def test_worked_example():
    orig = (1000, 2000)
    model = POLICY.model_size(*orig)
    assert model == (616, 1260)
    assert convert_coords([100, 200, 300, 400], "orig", "model", orig, model) == [63, 123, 189, 246]


def test_bounds_are_explicit_not_module_state():
    small = ResizePolicy(4 * 28 * 28, 64 * 28 * 28)
    assert small.model_size(1000, 2000) != POLICY.model_size(1000, 2000)
    assert ResizePolicy(256 * 32 * 32, 1024 * 32 * 32, 32).model_size(1000, 2000) == (704, 1440)


def test_aspect_ratio_over_200_names_the_size():
    with pytest.raises(PolicyError, match=r"4020x20 \(WxH\) has aspect ratio 201\.0"):
        POLICY.model_size(20, 4020)


def test_ratio_crossing_200_after_rounding_is_rejected_up_front():
    with pytest.raises(PolicyError, match=r"5771x29 \(WxH\) resizes to .* over the limit"):
        ResizePolicy(4 * 28 * 28, 16384 * 28 * 28).model_size(29, 5771)


def test_invalid_policy():
    with pytest.raises(PolicyError):
        ResizePolicy(1000, 10)
    with pytest.raises(PolicyError):
        ResizePolicy(10, 1000, 27)


def test_check_box_errors():
    for box, message in [([5, 5, 5, 9], "zero area"), ([9, 5, 2, 9], "inverted"), ([0, 0, 2001, 10], "outside"),
                         ([0, float("nan"), 3, 4], "non-finite")]:
        with pytest.raises(PolicyError, match=message):
            check_box(box, "orig", (1000, 2000), (616, 1260))


sizes = st.integers(min_value=28, max_value=6000)


@settings(max_examples=300, deadline=None)
@given(h=sizes, w=sizes, data=st.data())
def test_round_trip_within_one_model_pixel(h, w, data):
    assume(max(h, w) / min(h, w) <= 150)
    model = POLICY.model_size(h, w)
    assert model[0] % 28 == 0 and model[1] % 28 == 0
    x = data.draw(st.floats(0, w))
    y = data.draw(st.floats(0, h))
    there = convert_coords([x, y], "orig", "model", (h, w), model)
    assert there == [round(x * model[1] / w), round(y * model[0] / h)]  # by hand, not through the core
    back = map_coords(there, "model", "orig", (h, w), model)
    assert abs(back[0] - x) <= 0.5 * w / model[1] + 1e-6
    assert abs(back[1] - y) <= 0.5 * h / model[0] + 1e-6


@settings(max_examples=300, deadline=None)
@given(h=sizes, w=sizes, factor=st.sampled_from([28, 32]), low=st.integers(4, 400), span=st.integers(0, 4000))
def test_model_size_is_qwen_vl_utils_smart_resize(h, w, factor, low, span):
    """The core's frame against qwen_vl_utils' own smart_resize (the oracle users convert labels with)."""
    from qwen_vl_utils import smart_resize

    assume(max(h, w) / min(h, w) <= 150)
    policy = ResizePolicy(low * factor * factor, (low + span) * factor * factor, factor)
    expected = tuple(smart_resize(h, w, factor, min_pixels=policy.min_pixels, max_pixels=policy.max_pixels))
    try:
        got = policy.model_size(h, w)
    except PolicyError:  # refused up front only where the processor could not encode smart_resize's size
        assert min(expected) < factor or max(expected) / min(expected) > 200
    else:
        assert got == expected


@settings(max_examples=300, deadline=None)
@given(h=sizes, w=sizes, data=st.data())
def test_absolute_and_relative_agree(h, w, data):
    assume(max(h, w) / min(h, w) <= 150)
    model = POLICY.model_size(h, w)
    box = sorted(data.draw(st.lists(st.floats(0, w), min_size=2, max_size=2)))
    ys = sorted(data.draw(st.lists(st.floats(0, h), min_size=2, max_size=2)))
    coords = [box[0], ys[0], box[1], ys[1]]
    via_rel = map_coords(map_coords(coords, "orig", "rel1000", (h, w), model), "rel1000", "model", (h, w), model)
    direct = map_coords(coords, "orig", "model", (h, w), model)
    assert via_rel == pytest.approx(direct, rel=1e-9, abs=1e-9)
    rel1 = map_coords(coords, "orig", "rel1", (h, w), model)
    assert [v * 1000 for v in rel1] == pytest.approx(map_coords(coords, "orig", "rel1000", (h, w), model))
    clamped = convert_coords(coords, "orig", "rel1000", (h, w), model)
    assert all(0 <= v <= 1000 for v in clamped)


def test_torch_free_smart_resize_is_qwen_vl_utils_own(tmp_path):
    """The source-compiled smart_resize (no torch import) equals the real qwen_vl_utils one on many inputs."""
    import subprocess
    import sys

    code = (
        "import sys, json, random\n"
        "from llamafactory_qwenvl_patch.frame.smart_resize_source import load_smart_resize\n"
        "fast = load_smart_resize()\n"
        "assert 'torch' not in sys.modules and 'qwen_vl_utils' not in sys.modules\n"
        "rng = random.Random(7); out = []\n"
        "for _ in range(5000):\n"
        "    h, w, f = rng.randint(1, 9000), rng.randint(1, 9000), rng.choice([28, 32])\n"
        "    lo = rng.randint(1, 2000) * f * f // 4; hi = lo + rng.randint(0, 20000) * f\n"
        "    try: out.append([h, w, f, lo, hi, list(fast(h, w, f, min_pixels=lo, max_pixels=hi))])\n"
        "    except ValueError as e: out.append([h, w, f, lo, hi, str(e)])\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    from qwen_vl_utils import smart_resize

    rows = json.loads(result.stdout)
    for h, w, f, lo, hi, fast in rows:
        try:
            real = list(smart_resize(h, w, f, min_pixels=lo, max_pixels=hi))
        except ValueError as exc:
            real = str(exc)
        assert fast == real, (h, w, f, lo, hi)
    assert sum(isinstance(r[-1], str) for r in rows) > 0  # the aspect-ratio error path is covered too


@settings(max_examples=200, deadline=None)
@given(h=sizes, w=sizes, data=st.data())
def test_retarget_between_policies_matches_converting_from_the_original(h, w, data):
    """Labels made for one policy, moved to another, land within a pixel of labels made for it directly."""
    assume(max(h, w) / min(h, w) <= 150)
    low, high = ResizePolicy(64 * 28 * 28, 256 * 28 * 28), ResizePolicy(256 * 28 * 28, 2048 * 28 * 28)
    try:  # a size whose rounding crosses the processor's ratio limit (5615x38 -> 5628x28) has no labels to move
        low_hw, high_hw = low.model_size(h, w), high.model_size(h, w)
    except PolicyError:
        assume(False)
    x, y = data.draw(st.floats(0, w)), data.draw(st.floats(0, h))
    at_low = convert_coords([x, y], "orig", "model", (h, w), low_hw)
    moved = retarget_coords(at_low, "model", low_hw, "model", high_hw, (h, w))
    direct = convert_coords([x, y], "orig", "model", (h, w), high_hw)
    assert abs(moved[0] - direct[0]) <= 0.5 * high_hw[1] / low_hw[1] + 1
    assert abs(moved[1] - direct[1]) <= 0.5 * high_hw[0] / low_hw[0] + 1
    relative = retarget_coords(at_low, "model", low_hw, "rel1000", high_hw, (h, w), ndigits=None)
    assert relative == pytest.approx(map_coords(at_low, "model", "rel1000", (h, w), low_hw))  # frame-free


def test_policy_from_a_processor_and_sizes_from_its_grid():
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(patch_size=16, min_pixels=64 * 32 * 32, max_pixels=256 * 32 * 32)
    policy = ResizePolicy.from_processor(processor)
    assert policy == ResizePolicy(64 * 32 * 32, 256 * 32 * 32, 32)
    assert ResizePolicy.from_processor(processor, 1024, 4096) == ResizePolicy(1024, 4096, 32)
    image = Image.new("RGB", (1000, 700))
    grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert policy.size_from_grid(grid) == policy.model_size(700, 1000)


@settings(max_examples=60, deadline=None)
@given(h=st.integers(28, 1500), w=st.integers(28, 1500), low=st.integers(4, 200), span=st.integers(0, 1000),
       patch=st.sampled_from([14, 16]))
def test_model_size_is_what_the_hf_processor_encodes(h, w, low, span, patch):
    """An independent oracle: transformers' own image processor (its own resize code) encodes exactly the core's
    frame, read back from its image_grid_thw."""
    from transformers import Qwen2VLImageProcessor

    assume(max(h, w) / min(h, w) <= 150)
    factor = 2 * patch
    policy = ResizePolicy(low * factor * factor, (low + span) * factor * factor, factor)
    processor = Qwen2VLImageProcessor(patch_size=patch, min_pixels=policy.min_pixels, max_pixels=policy.max_pixels)
    try:
        expected = policy.model_size(h, w)
    except PolicyError:
        return  # refused up front (a side under one patch): the processor cannot encode it either
    grid = processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert policy.size_from_grid(grid) == expected
