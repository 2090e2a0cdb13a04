"""What an environment returns, checked where it runs (in its worker, before anything crosses a process), and the
check that the G resets of one task agree. Each failure is a message saying what was returned and where, never a
library traceback from deep in the trainer."""

from __future__ import annotations

import hashlib
import math
import numbers
import os
from typing import Any, Sequence

import numpy as np

from llamafactory_qwenvl_patch.agent.frame import ScreenshotError, readable, screenshot_size
from llamafactory_qwenvl_patch.agent.types import Observation, Step
from llamafactory_qwenvl_patch.frame.families import structure_token_in
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy

STATE_KEY = "state_key"
JSON_DEPTH = 32  # info's containers nested deeper (a list that holds itself) are written as their repr
JSON_ARRAY_ITEMS = 1000  # a numpy array in info up to this size is its values; a larger one (a frame) its repr
# LF's media placeholders, read as llamafactory.extras.constants reads them (this package does not import LF): LF's
# plugin expands each one in a message into media the environment did not send
MEDIA_PLACEHOLDERS = {kind: os.getenv(f"{kind.upper()}_PLACEHOLDER", f"<{kind}>")
                      for kind in ("image", "video", "audio")}


class BoundaryError(ValueError):
    """A value an environment returned that the trainer cannot take (wrong type, NaN reward, a screenshot the frame
    refuses); the message says what and for which turn."""


def check_observation(value: Any, policy: ResizePolicy, turn: int) -> Observation:
    """``value`` if it is an Observation whose text is a string and whose screenshot the frame takes."""
    if not isinstance(value, Observation):
        raise BoundaryError(f"returned a {type(value).__name__}, not an Observation")
    if not isinstance(value.text, str):
        raise BoundaryError(f"the observation's text is a {type(value.text).__name__}, not a str")
    _check_text(value.text, turn)
    try:
        screenshot_size(value.image, policy)
        readable(value.image)
    except ScreenshotError as exc:
        raise BoundaryError(f"the screenshot for turn {turn} is {exc}") from None
    return value


def _check_text(text: str, turn: int) -> None:
    """Observation text is shown as text: a token of the chat template in it would be read as that token (a forged
    turn end or image in the training row), a media placeholder would be expanded by LF's plugin, and a lone
    surrogate cannot be tokenised; each is refused here, naming it, rather than failing deep in the renderer."""
    where = f"the observation's text for turn {turn}"
    token = structure_token_in(text)
    if token is not None:
        raise BoundaryError(f"{where} holds {token!r}, a token of the model's chat template: it would be read as "
                            "that token, not as text")
    placeholder = next((kind for kind, tag in MEDIA_PLACEHOLDERS.items() if tag in text), None)
    if placeholder is not None:
        raise BoundaryError(f"{where} holds {MEDIA_PLACEHOLDERS[placeholder]!r}, LLaMA-Factory's {placeholder} "
                            "placeholder: it would be expanded into media the environment did not send")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BoundaryError(f"{where} is not encodable text ({exc.reason} at character {exc.start}): it cannot be "
                            "tokenised") from None


def _reward(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise BoundaryError(f"the reward is a {type(value).__name__}, not a number")
    try:
        reward = float(value)
    except OverflowError:
        raise BoundaryError("the reward is out of a float's range (over 1.8e308 in magnitude)") from None
    if not math.isfinite(reward):
        raise BoundaryError(f"the reward {reward} is not a finite number")
    return reward


def check_step(value: Any, policy: ResizePolicy, turn: int) -> Step:
    """A Step with its observation checked (the screenshot for ``turn``), its reward a finite float, ``done`` a bool
    and ``info`` a dict whose ``state_key``, if any, is hashable; returned with plain ``float`` and ``bool``."""
    if not isinstance(value, Step):
        raise BoundaryError(f"returned a {type(value).__name__}, not a Step")
    check_observation(value.observation, policy, turn)
    reward = _reward(value.reward)
    if not isinstance(value.done, (bool, np.bool_)):
        raise BoundaryError(f"done is a {type(value.done).__name__}, not a bool")
    if not isinstance(value.info, dict):
        raise BoundaryError(f"info is a {type(value.info).__name__}, not a dict")
    key = next((key for key in value.info if not isinstance(key, str)), None)
    if key is not None:
        raise BoundaryError(f"info has a key that is not a str ({type(key).__name__} {key!r:.40}): it is written "
                            "as JSON, where 1 and '1' would be one key")
    if STATE_KEY in value.info:
        try:
            hash(value.info[STATE_KEY])
        except TypeError:
            raise BoundaryError(f"info[{STATE_KEY!r}] is a {type(value.info[STATE_KEY]).__name__}, which cannot "
                                "name a state (it must be hashable: a str, an int, a tuple)") from None
    return Step(value.observation, reward, bool(value.done), value.info)


def fingerprint(observation: Observation) -> tuple[str, tuple[int, int], str, str]:
    """What makes two first observations the same: the screenshot's pixels (a hash of its data and its palette, if
    any: a palette image's data are indices, its colours are the palette's), size and mode, and the text."""
    image = observation.image
    digest = hashlib.sha256(image.tobytes())
    digest.update(bytes(image.getpalette(None) or ()))
    return digest.hexdigest(), image.size, image.mode, observation.text


def group_start_error(observations: Sequence[Observation], task: str) -> str | None:
    """None when the first observations of a group's trajectories (G resets of one task with one seed) are the same;
    otherwise a message naming the task and the members that differ from the first, and how. A group needs one start:
    its advantages compare trajectories from the same screen."""
    prints = [fingerprint(observation) for observation in observations]
    differ = [i for i, p in enumerate(prints) if p != prints[0]]
    if not differ:
        return None
    parts = ("screenshot's pixels", "screenshot's size", "screenshot's mode", "text")
    how = [part for k, part in enumerate(parts) if any(prints[i][k] != prints[0][k] for i in differ)]
    return (f"task {task}: {len(differ)} of {len(observations)} resets with the same seed differ from the first "
            f"(members {', '.join(map(str, differ))}, in their {' and '.join(how)}); a group needs one start: make "
            "reset(task, seed) deterministic in (task, seed)")


def json_value(value: Any, depth: int = 0) -> Any:
    """``value`` (an environment's ``info``) as strict JSON holds it, for the rewards, the completions log and
    agent-eval's rows: str, int, bool, None, finite floats, lists and str-keyed dicts kept; a non-finite float and
    anything else (a set, an object, a dict with other keys, a container nested past ``JSON_DEPTH``: a cycle) as its
    repr, so a row stays valid JSON (``allow_nan=False``) and nothing is dropped or merged. numpy scalars and arrays
    are their Python values (``np.False_`` stays false, not the truthy text ``'np.False_'``), an array of more than
    ``JSON_ARRAY_ITEMS`` numpy's summarising repr (an observation array would be millions of numbers); a str that is not
    encodable text (a lone surrogate) is its repr, so the row can be written."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.size <= JSON_ARRAY_ITEMS):
        value = value.item() if isinstance(value, np.generic) else value.tolist()
    if isinstance(value, str):
        return value if _encodable(value) else repr(value)
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(float(value))
    if depth < JSON_DEPTH and isinstance(value, (list, tuple)):
        return [json_value(item, depth + 1) for item in value]
    if depth < JSON_DEPTH and isinstance(value, dict) and all(isinstance(key, str) and _encodable(key)
                                                              for key in value):
        return {key: json_value(item, depth + 1) for key, item in value.items()}
    return repr(value)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
