"""What an environment returns, checked where it runs (in its worker, before anything crosses a process), and the
check that the G resets of one task agree. Each failure is a message saying what was returned and where, never a
library traceback from deep in the trainer."""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Any, Sequence

import numpy as np

from llamafactory_qwenvl_patch.agent.frame import ScreenshotError, screenshot_size
from llamafactory_qwenvl_patch.agent.types import Observation, Step
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy

STATE_KEY = "state_key"


class BoundaryError(ValueError):
    """A value an environment returned that the trainer cannot take (wrong type, NaN reward, a screenshot the frame
    refuses); the message says what and for which turn."""


def check_observation(value: Any, policy: ResizePolicy, turn: int) -> Observation:
    """``value`` if it is an Observation whose text is a string and whose screenshot the frame takes."""
    if not isinstance(value, Observation):
        raise BoundaryError(f"returned a {type(value).__name__}, not an Observation")
    if not isinstance(value.text, str):
        raise BoundaryError(f"the observation's text is a {type(value.text).__name__}, not a str")
    try:
        screenshot_size(value.image, policy)
    except ScreenshotError as exc:
        raise BoundaryError(f"the screenshot for turn {turn} is {exc}") from None
    return value


def _reward(value: Any) -> float:
    if not isinstance(value, numbers.Real):
        raise BoundaryError(f"the reward is a {type(value).__name__}, not a number")
    reward = float(value)
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
    if STATE_KEY in value.info:
        try:
            hash(value.info[STATE_KEY])
        except TypeError:
            raise BoundaryError(f"info[{STATE_KEY!r}] is a {type(value.info[STATE_KEY]).__name__}, which cannot "
                                "name a state (it must be hashable: a str, an int, a tuple)") from None
    return Step(value.observation, reward, bool(value.done), value.info)


def fingerprint(observation: Observation) -> tuple[str, tuple[int, int], str, str]:
    """What makes two first observations the same: the screenshot's pixels (a hash), size and mode, and the text."""
    image = observation.image
    return hashlib.sha256(image.tobytes()).hexdigest(), image.size, image.mode, observation.text


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
