"""Issue 50, item 2: every screenshot in the pinned frame, every action back in the screen's pixels. Answers are read
by the one parser (``scoring.actions`` on ``scoring.answers``) in each family's convention and mapped through that
turn's sizes by the frame core; round trips per family on odd sizes (a phone, 4K, a portrait tablet, near 200:1,
under min_pixels), a scripted agent that answers in the model's frame hits every target, one that answers in the
screen's pixels misses every resized screen, and whatever cannot be read is ``invalid`` with a reason, never
clamped."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from llamafactory_qwenvl_patch.agent import Action
from llamafactory_qwenvl_patch.agent.frame import (ScreenshotError, answer_text, model_screen, read_action,
                                                   screenshot_size)
from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy, convert_coords, frame_extent
from llamafactory_qwenvl_patch.scoring.clicks import click_hit

FAMILY_NAMES = sorted(FAMILIES)


def policy_of(family: str) -> ResizePolicy:
    """Bounds that resize every screen below (down for the large ones, up for 20x20), in the family's factor."""
    factor = FAMILIES[family].factor
    return ResizePolicy(64 * factor * factor, 512 * factor * factor, factor)


def near_200_to_1(policy: ResizePolicy) -> tuple[int, int]:
    """6000x30 (200:1) if the policy takes it, else the widest 30-pixel-high screen it does (its rounding can push
    the model input's ratio past 200: 5992x28 for factor 28)."""
    for width in range(6000, 5000, -1):
        try:
            policy.model_size(30, width)
            return 30, width
        except PolicyError:
            continue
    raise AssertionError("no screen near 200:1 is accepted")


ODD_SIZES = {"phone 1170x2532": (2532, 1170), "4K 3840x2160": (2160, 3840), "tablet 800x1280": (1280, 800),
             "near 200:1": None, "under min_pixels 20x20": (20, 20)}


def screen_sizes(family: str, size: str) -> tuple[str, tuple[int, int], tuple[int, int]]:
    """(convention, orig_hw, model_hw) of one odd screen under the family's policy."""
    policy = policy_of(family)
    orig_hw = ODD_SIZES[size] or near_200_to_1(policy)
    return FAMILIES[family].coords, orig_hw, policy.model_size(*orig_hw)


def click(point) -> str:
    return json.dumps({"action": "click", "point_2d": list(point)})


def test_the_odd_sizes_are_resized_in_every_family():
    """The sizes below are all resized (so the round trips and misses test a mapping, not the identity), both ways:
    down for the large screens, up under min_pixels; near 200:1 is the widest each policy takes."""
    for family in FAMILY_NAMES:
        for size in ODD_SIZES:
            _, orig_hw, model_hw = screen_sizes(family, size)
            assert model_hw != orig_hw, (family, size)
        assert screen_sizes(family, "under min_pixels 20x20")[2][0] > 20
    assert screen_sizes("qwen3_vl", "near 200:1")[1] == (30, 6000)
    assert screen_sizes("qwen2_5_vl", "near 200:1")[1][1] < 6000  # 6000x30 would be 5992x28 after rounding


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_screenshot_becomes_the_training_frame(family):
    """The model-input image is image_io's (the function training images go through), of the policy's size."""
    policy = policy_of(family)
    for size in ODD_SIZES:
        _, orig_hw, model_hw = screen_sizes(family, size)
        screen = model_screen(Image.new("RGB", orig_hw[::-1], (40, 90, 200)), policy)
        assert (screen.orig_hw, screen.model_hw) == (orig_hw, model_hw)
        assert screen.image.size == model_hw[::-1] and screen.image.mode == "RGB"


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("size", list(ODD_SIZES))
def test_round_trips_per_family_on_odd_sizes(family, size):
    """Model -> screen -> model is the identity for every whole model-frame point (the screen point is a float);
    with the screen rounding to whole pixels, it stays the identity on every axis the model frame shrinks; and
    screen -> model -> screen, rounded, is the identity on every axis it enlarges."""
    convention, orig_hw, model_hw = screen_sizes(family, size)
    width, height = frame_extent(convention, orig_hw, model_hw)
    for mx in sorted({0, 1, int(width) // 3, int(width) // 2, int(width) - 1, int(width)}):
        for my in sorted({0, 1, int(height) // 3, int(height) // 2, int(height) - 1, int(height)}):
            action = read_action(click((mx, my)), convention, orig_hw, model_hw)
            assert action.kind == "click", action.reason
            assert json.loads(answer_text(action, convention, orig_hw, model_hw))["point_2d"] == [mx, my]
            whole = Action("click", round(action.x), round(action.y))
            back = json.loads(answer_text(whole, convention, orig_hw, model_hw))["point_2d"]
            for axis, (extent, side) in enumerate(((width, orig_hw[1]), (height, orig_hw[0]))):
                if extent <= side:
                    assert back[axis] == (mx, my)[axis], (axis, extent, side)
    for x in sorted({0, 1, orig_hw[1] // 2, orig_hw[1] - 1, orig_hw[1]}):
        for y in sorted({0, 1, orig_hw[0] // 2, orig_hw[0] - 1, orig_hw[0]}):
            mapped = read_action(answer_text(Action("click", x, y), convention, orig_hw, model_hw), convention,
                                 orig_hw, model_hw)
            for axis, (extent, side) in enumerate(((width, orig_hw[1]), (height, orig_hw[0]))):
                if extent >= side:
                    assert round((mapped.x, mapped.y)[axis]) == (x, y)[axis], (axis, extent, side)


@settings(max_examples=300, deadline=None)
@given(family=st.sampled_from(FAMILY_NAMES), height=st.integers(20, 5000), width=st.integers(20, 5000),
       mx=st.floats(0, 1), my=st.floats(0, 1), px=st.floats(0, 1), py=st.floats(0, 1))
def test_round_trips_on_any_screen(family, height, width, mx, my, px, py):
    """The same on random screens the policy takes: any whole model point comes back exactly; on shrunk axes also
    through whole screen pixels; on enlarged axes whole screen pixels come back."""
    policy = policy_of(family)
    try:
        model_hw = policy.model_size(height, width)
    except PolicyError:
        assume(False)
    convention, orig_hw = FAMILIES[family].coords, (height, width)
    extent = frame_extent(convention, orig_hw, model_hw)
    point = [round(mx * extent[0]), round(my * extent[1])]
    action = read_action(click(point), convention, orig_hw, model_hw)
    assert json.loads(answer_text(action, convention, orig_hw, model_hw))["point_2d"] == point
    pixel = [round(px * width), round(py * height)]
    through_model = read_action(answer_text(Action("click", *pixel), convention, orig_hw, model_hw), convention,
                                orig_hw, model_hw)
    whole = json.loads(answer_text(Action("click", round(action.x), round(action.y)), convention, orig_hw,
                                   model_hw))["point_2d"]
    for axis, side in enumerate((width, height)):
        if extent[axis] <= side:
            assert whole[axis] == point[axis]
        if extent[axis] >= side:
            assert round((through_model.x, through_model.y)[axis]) == pixel[axis]


def target_box(orig_hw: tuple[int, int]) -> tuple[float, float, float, float]:
    """A control a twentieth of the screen's sides wide, away from the origin (so that scaling a point moves it
    out of the control)."""
    height, width = orig_hw
    return 0.575 * width, 0.575 * height, 0.625 * width, 0.625 * height


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_an_agent_answering_in_the_model_frame_hits_every_screen_and_one_in_screen_pixels_misses(family):
    """The scripted agent reads the control in the model's frame (as convert writes labels) and answers its
    centre in whole numbers: every click lands in the control. The same agent answering the control's centre in the
    screen's own pixels (the drift the issue names) misses every resized screen: out of the frame or elsewhere."""
    for size in ODD_SIZES:
        convention, orig_hw, model_hw = screen_sizes(family, size)
        box = target_box(orig_hw)
        x1, y1, x2, y2 = convert_coords(box, "orig", convention, orig_hw, model_hw, ndigits=None)
        action = read_action(click((round((x1 + x2) / 2), round((y1 + y2) / 2))), convention, orig_hw, model_hw)
        assert action.kind == "click" and click_hit((action.x, action.y), box), (size, action)
        pixels = read_action(click((round((box[0] + box[2]) / 2), round((box[1] + box[3]) / 2))), convention,
                             orig_hw, model_hw)
        assert pixels.kind == "invalid" or not click_hit((pixels.x, pixels.y), box), (size, pixels)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_out_of_frame_non_finite_missing_or_unreadable_is_invalid_never_clamped(family):
    convention, orig_hw, model_hw = screen_sizes(family, "phone 1170x2532")
    width, height = frame_extent(convention, orig_hw, model_hw)
    cases = {
        click((width + 0.5, 10)): "outside",
        click((10, height + 1)): "outside",
        click((-1, 10)): "outside",
        '{"action": "click", "point_2d": [NaN, 10]}': "not finite",
        '{"action": "click", "point_2d": [1e999, 10]}': "not finite",
        '{"action": "click"}': "needs a point_2d",
        '{"action": "click", "point_2d": [1, 2, 3]}': "2 numbers",
        '{"action": "scroll", "point_2d": [1, 2]}': "direction",
        '{"action": "scroll", "point_2d": [1, 2], "direction": "sideways"}': "sideways",
        '{"action": "type"}': "text",
        '{"action": "key", "key": ""}': "key",
        '{"action": "drag", "point_2d": [1, 2]}': "not one of",
        click((1, 2)) + " then " + click((3, 4)): "2 actions",
        '{"action": "click", "action": "done"}': "appears twice",
        "I would click the Save button.": "no action",
        "": "no action",
    }
    for raw, reason in cases.items():
        action = read_action(raw, convention, orig_hw, model_hw)
        assert action.kind == "invalid" and action.x is None and action.y is None, raw
        assert reason in action.reason and action.raw == raw, (raw, action.reason)
    edge = read_action(click((width, height)), convention, orig_hw, model_hw)  # the frame's edge is in it
    assert (edge.kind, edge.x, edge.y) == ("click", orig_hw[1], orig_hw[0])


def test_every_kind_is_read_with_its_fields_and_the_raw_text():
    convention, orig_hw, model_hw = screen_sizes("qwen2_5_vl", "phone 1170x2532")
    raw = 'Scrolling: ```json\n{"action": "Scroll", "point_2d": [210, 462], "direction": "DOWN"}\n```'
    scroll = read_action(raw, convention, orig_hw, model_hw)
    assert (scroll.kind, scroll.direction, scroll.raw) == ("scroll", "down", raw)
    assert (scroll.x, scroll.y) == pytest.approx((210 * 1170 / 420, 462 * 2532 / 924))
    typed = read_action('{"action": "type", "text": "héllo wörld"}', convention, orig_hw, model_hw)
    assert (typed.kind, typed.text, typed.x) == ("type", "héllo wörld", None)
    assert read_action('{"action": "key", "key": "Enter"}', convention, orig_hw, model_hw).key == "Enter"
    assert read_action('{"action": "done"}', convention, orig_hw, model_hw).kind == "done"
    for action in (scroll, typed, Action("key", key="Enter"), Action("done")):  # and back: the same fields
        text = answer_text(action, convention, orig_hw, model_hw)
        back = read_action(text, convention, orig_hw, model_hw)
        assert (back.kind, back.text, back.direction, back.key, back.raw) == (action.kind, action.text,
                                                                              action.direction, action.key, text)
    assert json.loads(answer_text(scroll, convention, orig_hw, model_hw))["point_2d"] == [210, 462]


def test_the_inverse_refuses_what_has_no_answer():
    convention, orig_hw, model_hw = screen_sizes("qwen3_vl", "phone 1170x2532")
    with pytest.raises(ValueError, match="invalid action has no answer"):
        answer_text(Action("invalid", raw="?", reason="no action"), convention, orig_hw, model_hw)
    with pytest.raises(PolicyError, match="outside the orig frame 1170x2532"):
        answer_text(Action("click", 1171.0, 5.0), convention, orig_hw, model_hw)
    with pytest.raises(PolicyError, match="non-finite"):
        answer_text(Action("click", math.nan, 5.0), convention, orig_hw, model_hw)
    with pytest.raises(ValueError, match="kind 'tap' is not one of"):
        Action("tap", 1.0, 2.0)


def test_screenshots_the_frame_refuses_are_named_with_their_size():
    policy = policy_of("qwen3_vl")
    assert screenshot_size(Image.new("RGB", (1170, 2532)), policy) == ((2532, 1170), (1056, 480))
    cases = {(1, 5000): "1x5000 (WxH) has aspect ratio 5000.0", (0, 0): "0x0 (WxH) is empty",
             (10000, 10000): "10000x10000 (WxH) is 100,000,000 pixels, over PIL's decompression-bomb limit"}
    for size, message in cases.items():
        with pytest.raises(ScreenshotError, match=message.replace("(", r"\(").replace(")", r"\)")):
            screenshot_size(Image.new("L", size), policy)
    with pytest.raises(ScreenshotError, match="a ndarray, not a PIL image"):
        import numpy as np

        screenshot_size(np.zeros((10, 10, 3)), policy)
