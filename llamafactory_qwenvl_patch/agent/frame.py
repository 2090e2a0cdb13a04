"""Every screenshot in the pinned frame, every action back in the screen's pixels.

A turn's screenshot becomes the model-input image through the same function as training images
(``image_io.images.model_input_image``, checked against ``ResizePolicy.model_size``); the turn keeps its
``orig_hw`` and ``model_hw``. The model's answer is read by the one answer parser (``scoring.actions``), its point
checked in the family's convention (``frame.policy.check_point``) and mapped once through that turn's sizes
(``convert_coords``), so ``Action.x, Action.y`` are pixels of the screenshot shown that turn. Outside the frame,
non-finite, missing or unreadable: ``invalid`` with the reason, never clamped (clamping teaches edge clicks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from PIL import Image

from llamafactory_qwenvl_patch.agent.types import INVALID, Action
from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy, check_point, convert_coords
from llamafactory_qwenvl_patch.image_io.images import model_input_image
from llamafactory_qwenvl_patch.scoring.actions import ACTION_KEY, parse_action
from llamafactory_qwenvl_patch.scoring.answers import AnswerError

Size = tuple[int, int]  # (height, width)


class ScreenshotError(ValueError):
    """A screenshot the frame cannot take: not an image, empty, too thin, too elongated or too large; the message
    names its size."""


def screenshot_size(image: Any, policy: ResizePolicy) -> tuple[Size, Size]:
    """(orig_hw, model_hw) of a screenshot, or ScreenshotError. Beyond the policy's own refusals (empty, an aspect
    ratio over 200, a side under one patch after resizing), a screenshot over PIL's decompression-bomb limit
    (``Image.MAX_IMAGE_PIXELS``, where PIL warns; ``image_io`` refuses files at twice it) is refused: no screen is
    that large (8K is 33 MP), and such an image would be copied between processes and resized every turn."""
    if not isinstance(image, Image.Image):
        raise ScreenshotError(f"a {type(image).__name__}, not a PIL image")
    width, height = image.size
    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise ScreenshotError(f"{width}x{height} (WxH) is {width * height:,} pixels, over PIL's decompression-bomb "
                              f"limit of {limit:,} (Image.MAX_IMAGE_PIXELS)")
    try:
        return (height, width), policy.model_size(height, width)
    except PolicyError as exc:
        raise ScreenshotError(str(exc)) from None


def readable(image: Image.Image) -> None:
    """ScreenshotError unless ``image``'s pixels decode and its mode turns into RGB (PIL cannot convert ``La`` or
    ``BGR;24``; a file opened lazily may be cut short): checked on one pixel, where the environment runs, so the
    failure is the environment's, named, instead of the resize's deep in the trainer."""
    try:
        image.load()
        image.crop((0, 0, 1, 1)).convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:  # SyntaxError: PIL's word for some broken files
        raise ScreenshotError(f"a {image.width}x{image.height} (WxH) image in mode {image.mode} that cannot be read "
                              f"as RGB ({exc})") from None


@dataclass(frozen=True)
class Screen:
    """One turn's screenshot as the model sees it: the model-input image and the two sizes its actions map
    between."""

    image: Image.Image  # the model-input image, model_hw in size
    orig_hw: Size  # the screenshot's (height, width): the environment's pixels
    model_hw: Size  # the model input's (height, width)


def model_screen(screenshot: Image.Image, policy: ResizePolicy) -> Screen:
    """The screenshot in the pinned frame (ScreenshotError for one the frame refuses)."""
    orig_hw, model_hw = screenshot_size(screenshot, policy)
    readable(screenshot)
    return Screen(model_input_image(screenshot, policy), orig_hw, model_hw)


def read_action(raw: str, convention: str, orig_hw: Size, model_hw: Size) -> Action:
    """The action a model's answer names, in pixels of the screenshot it answered (``orig_hw``, shown to it as
    ``model_hw``); its point is read in ``convention`` (the family's: ``model`` or ``rel1000``). ``invalid``, with
    the reason, for anything the parser refuses or a point outside the frame."""
    try:
        parsed = parse_action(raw)
        x = y = None
        if parsed.point is not None:
            check_point(parsed.point, convention, orig_hw, model_hw)
            x, y = convert_coords(parsed.point, convention, "orig", orig_hw, model_hw, ndigits=None)
    except (AnswerError, PolicyError) as exc:
        return Action(INVALID, raw=raw, reason=str(exc))
    return Action(parsed.kind, x, y, parsed.text, parsed.direction, parsed.key, raw=raw)


def answer_text(action: Action, convention: str, orig_hw: Size, model_hw: Size) -> str:
    """The answer that names ``action`` in the model's frame: the inverse of ``read_action``, for SFT data and tests.
    The point (screen pixels) is mapped through this screenshot's sizes and rounded once, as labels are; PolicyError
    for a point outside the screenshot, ValueError for an ``invalid`` action (it has no answer)."""
    if action.kind == INVALID:
        raise ValueError(f"an invalid action has no answer to write (its reason: {action.reason})")
    answer: dict[str, Any] = {ACTION_KEY: action.kind}
    if action.x is not None or action.y is not None:
        point = [action.x, action.y]
        check_point(point, "orig", orig_hw, model_hw)
        answer["point_2d"] = convert_coords(point, "orig", convention, orig_hw, model_hw)
    for key in ("text", "direction", "key"):
        if getattr(action, key) is not None:
            answer[key] = getattr(action, key)
    return json.dumps(answer, ensure_ascii=False)
