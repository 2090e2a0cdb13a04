"""The frame keys as LLaMA-Factory reads them, one rule for every reader: the plugin (after LF reads the YAML, before
its argument classes compare the values), ``qwenvl-prep``'s YAML reader and flags, and the video policy.

LF 0.9.5 reads a YAML with OmegaConf and hands each value to its argument classes untouched (``parse_dict`` converts
nothing). So ``1e6`` arrives as the float 1000000.0, which LF's resize uses as 1,000,000; ``"50176"`` (quoted) as text,
on which ``image_max_pixels < image_min_pixels`` raises ``TypeError`` naming no key; ``null`` as None, likewise. The
rule: a count key (pixels, ``video_maxlen``) is an int, or a float with a whole value, taken as that int; a rate
(``video_fps``, ``qwenvl_frame_list_fps``) is a finite number; both > 0. Anything else (true/false, text, quoted
numbers included, null, lists, fractions of a pixel) is one ``FrameKeyError`` naming the key, the value and the fix.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from llamafactory_qwenvl_patch.frame.policy import PolicyError

COUNT_KEYS = ("image_min_pixels", "image_max_pixels", "video_min_pixels", "video_max_pixels", "video_maxlen")
RATE_KEYS = ("video_fps", "qwenvl_frame_list_fps")
FRAME_KEYS = COUNT_KEYS + RATE_KEYS
UNSET_BY_NULL = ("qwenvl_frame_list_fps",)  # the plugin's own key, whose default is None ("use video_fps")
_PRODUCT = re.compile(r"\s*\d+(?:\s*[*x×]\s*\d+)+\s*")
_SEPARATORS = re.compile(r"[\s,_']")


class FrameKeyError(PolicyError):
    """A frame key whose value is no number LF can use; the message names the key, the value and the fix."""


def frame_key(key: str, value: Any) -> int | float:
    """The number LF uses for ``value`` of the frame key ``key`` (an int for counts, a float for rates), or
    FrameKeyError."""
    if key not in FRAME_KEYS:
        raise KeyError(f"{key!r} is not a frame key ({', '.join(FRAME_KEYS)})")
    counts = key in COUNT_KEYS
    wanted = "a whole number > 0" if counts else "a number > 0"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise FrameKeyError(f"{key} must be a finite number > 0, got {value!r}")
        if value <= 0:
            raise FrameKeyError(f"{key} must be > 0, got {value!r}")
        if not counts:
            return float(value)
        if value != int(value):
            raise FrameKeyError(f"{key} must be a whole number of {_unit(key)}, got {value!r}; write e.g. "
                                f"{key}: {round(value)}")
        return int(value)
    if value is None:
        raise FrameKeyError(f"{key} is null, which LLaMA-Factory cannot use; remove the key for its default, or "
                            f"write {wanted}")
    if isinstance(value, str):
        fix = _meant(value, counts)
        hint = f"write {key}: {fix}" if fix is not None else f"write {wanted}"
        raise FrameKeyError(f"{key} is the text {value!r}, not a number (YAML reads quotes, thousands separators and "
                            f"products as text, and LLaMA-Factory stops on text); {hint}")
    raise FrameKeyError(f"{key} must be {wanted}, got {value!r} ({type(value).__name__}); write e.g. {key}: "
                        f"{1003520 if counts else 2.0}")


def frame_keys(config: Mapping[str, Any]) -> dict[str, int | float]:
    """Each frame key ``config`` holds, as ``frame_key`` takes it (a null ``qwenvl_frame_list_fps`` is its default,
    and left out)."""
    return {key: frame_key(key, value) for key, value in config.items()
            if key in FRAME_KEYS and not (value is None and key in UNSET_BY_NULL)}


def _unit(key: str) -> str:
    return "frames" if key == "video_maxlen" else "pixels"


def _meant(text: str, counts: bool) -> int | float | None:
    """The number a text was probably meant to be (``"50176"``, ``50,176``, ``1280*28*28``), None when unclear."""
    if _PRODUCT.fullmatch(text):
        return math.prod(int(part) for part in re.split(r"[*x×]", text))
    try:
        number = float(_SEPARATORS.sub("", text))
    except ValueError:
        return None
    if not (math.isfinite(number) and number > 0) or (counts and number != int(number)):
        return None
    return int(number) if counts else number
