"""A simulated GUI environment for multi-turn agents, shipped for the tests, the agent demo and users to copy.

``ClickThroughEnv`` (``qwenvl_prep.demos.gui_env:ClickThroughEnv``): a task is K screens drawn as the GUI demo draws
its screenshots (``demos.gui.draw_screen``: real screen sizes, a title bar, grey clutter, labelled buttons and icons),
each naming in the observation's text the control to press. A click inside that control (in the screenshot's own
pixels) opens the next screen; any other action leaves the screen as it is. Reward: 1 on the step that passes the
last screen, 0 on every other step, so a trajectory's rewards sum to 1 exactly when it succeeds. The episode ends
there, or on a ``done`` action. ``info["state_key"]`` is the index of the screen now shown (K once all are passed).

The task (a record's ``meta``) may give ``screens`` (K, else the constructor's), ``platform`` (``desktop``,
``laptop``, ``phone``, ``tablet``; else drawn from the seed) and ``faults`` (as the constructor's, for this task's
episodes only: one task of a run can fail); the screens are a function of (task, seed) alone, so the
G trajectories of a group start on one screen and a relaunch redraws the same tasks.

Test switches (keyword arguments, JSON-able as ``grpo_agent_env_kwargs`` are): ``change_size`` (each next screen on
the next platform's size: the screen changes size mid-episode), ``reader`` (``click``; ``text``: a turn passes when
its ``type`` action's text contains ``letter``; ``raw``: when the model's raw answer does, the learning test's rule
for an untrained model that writes no JSON yet), ``faults`` (``{call: fault}``, a call being ``reset``, ``step1``,
``step2``, ... or ``close``; see ``FAULTS``; ``die`` ends the process it runs in, so use it under process isolation
only) and ``nondeterministic_reset`` (each reset changes one pixel at random: G resets of one task differ).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from llamafactory_qwenvl_patch.agent import Action, Observation, Step
from llamafactory_qwenvl_patch.scoring.clicks import click_hit
from qwenvl_prep.demos.gui import MAX_CONTROLS, SCREENS, draw_screen

PLATFORMS = tuple(SCREENS)
READERS = ("click", "text", "raw")
FAULTS = {
    "raise": "the call raises RuntimeError",
    "hang": "the call sleeps hang_seconds (default an hour)",
    "die": "the process ends at once (os._exit(3))",
    "wrong_type": "reset returns a dict, step a gym-style (observation, reward, done, info) tuple",
    "nan_reward": "the step's reward is NaN",
    "inf_reward": "the step's reward is inf",
    "tall_image": "the screenshot is 1x5000 (aspect ratio 5000)",
    "empty_image": "the screenshot is 0x0",
    "huge_image": "the screenshot is 10000x10000 (100 megapixels)",
    "not_image": "the screenshot is the drawn numpy array, not a PIL image",
}
_CALL = re.compile(r"reset|close|step[1-9]\d*")
MAX_SCREENS = 100
DIE_CODE = 3


@dataclass(frozen=True)
class TaskScreen:
    """One screen of a task: the screenshot, the label of the control to press and its box in the screenshot's
    pixels (x1, y1, x2, y2; the control covers x1 <= x <= x2, y1 <= y <= y2)."""

    image: Image.Image
    label: str
    box: tuple[int, int, int, int]
    platform: str


def _platform(task: dict, seed: int, index: int, change_size: bool) -> str:
    start = task.get("platform")
    if start is None:
        start = random.Random(f"{json.dumps(task, sort_keys=True, default=str)}|{seed}|platform").choice(PLATFORMS)
    elif start not in PLATFORMS:
        raise ValueError(f"task platform {start!r} is not one of {', '.join(PLATFORMS)}")
    return PLATFORMS[(PLATFORMS.index(start) + index) % len(PLATFORMS)] if change_size else start


def draw_task_screen(task: dict, seed: int, index: int, controls: int = 2, change_size: bool = False) -> TaskScreen:
    """Screen ``index`` of ``task`` for ``seed``: a function of these arguments alone (string seeds hash the same in
    every process). ``controls`` labelled controls are drawn; the one to press is drawn from the same seed."""
    platform = _platform(task, seed, index, change_size)
    rng = random.Random(f"{json.dumps(task, sort_keys=True, default=str)}|{seed}|{index}")
    canvas, elements = draw_screen(SCREENS[platform], rng, controls)  # the first control always fits
    target = rng.choice(elements)
    image = Image.fromarray(np.ascontiguousarray(canvas[:, :, ::-1]))  # OpenCV's BGR to RGB
    return TaskScreen(image, target.label, target.box, platform)


def _bad_image(fault: str, screen: TaskScreen) -> Any:
    if fault == "tall_image":
        return Image.new("RGB", (1, 5000))
    if fault == "empty_image":
        return Image.new("RGB", (0, 0))
    if fault == "huge_image":
        return Image.new("L", (10000, 10000))
    return np.asarray(screen.image)  # not_image


def _checked_faults(faults: Any) -> dict[str, str]:
    if faults is None:
        return {}
    if not isinstance(faults, dict):
        raise ValueError(f"faults must be an object of call: fault, got {faults!r}")
    for call, fault in faults.items():
        if not _CALL.fullmatch(str(call)) or fault not in FAULTS:
            raise ValueError(f"fault {call!r}: {fault!r}: calls are reset, step1, step2, ..., close; faults are "
                             f"{', '.join(FAULTS)}")
    return dict(faults)


class ClickThroughEnv:
    """K screens, each passed by pressing the control it names (see the module's docstring)."""

    def __init__(self, screens: int = 3, controls: int = 2, change_size: bool = False, reader: str = "click",
                 letter: str = "e", faults: dict[str, str] | None = None, nondeterministic_reset: bool = False,
                 hang_seconds: float = 3600.0) -> None:
        if reader not in READERS:
            raise ValueError(f"reader {reader!r} is not one of {', '.join(READERS)}")
        if not 1 <= controls <= MAX_CONTROLS:
            raise ValueError(f"controls must be 1 to {MAX_CONTROLS}, got {controls!r}")
        self.screens, self.controls, self.change_size = _screen_count(screens), controls, change_size
        self.reader, self.letter = reader, letter
        self.run_faults = self.faults = _checked_faults(faults)  # the run's; an episode adds its task's own
        self.nondeterministic_reset, self.hang_seconds = nondeterministic_reset, hang_seconds
        self.task: dict = {}
        self.seed, self.count, self.index, self.steps, self.done = 0, 0, 0, 0, False
        self.screen: TaskScreen | None = None

    def reset(self, task: dict, seed: int) -> Observation:
        task = dict(task or {})
        self.faults = {**self.run_faults, **_checked_faults(task.get("faults"))}
        self._before("reset")
        self.task, self.seed = task, seed
        self.count = _screen_count(self.task.get("screens", self.screens))
        self.index, self.steps, self.done = 0, 0, False
        observation = self._observe()
        if self.nondeterministic_reset:
            image, chance = observation.image.copy(), random.SystemRandom()
            image.putpixel((chance.randrange(image.width), chance.randrange(image.height)),
                           tuple(chance.randrange(256) for _ in range(3)))
            observation = replace(observation, image=image)
        return self._after("reset", observation)

    def step(self, action: Action) -> Step:
        self.steps += 1
        call = f"step{self.steps}"
        self._before(call)
        if self.done or self.screen is None:
            raise RuntimeError(f"{call}: the episode has ended (or was never reset); reset first")
        passed = self._passes(action)
        if passed:
            self.index += 1
        finished = self.index == self.count
        self.done = finished or action.kind == "done"
        observation = (Observation(self.screen.image, f"All {self.count} screens done.") if finished
                       else self._observe())
        step = Step(observation, 1.0 if finished else 0.0, self.done, {"state_key": self.index, "passed": passed})
        return self._after(call, step)

    def close(self) -> None:
        self._before("close")
        self.screen = None

    def _observe(self) -> Observation:
        self.screen = draw_task_screen(self.task, self.seed, self.index, self.controls, self.change_size)
        what = f"press {self.screen.label}" if self.reader == "click" else "type a word"
        return Observation(self.screen.image, f"Screen {self.index + 1} of {self.count}: {what}.")

    def _passes(self, action: Action) -> bool:
        if self.reader == "text":
            return action.kind == "type" and self.letter in (action.text or "")
        if self.reader == "raw":
            return self.letter in action.raw
        return (action.kind == "click" and action.x is not None and action.y is not None
                and click_hit((action.x, action.y), self.screen.box))

    def _before(self, call: str) -> None:
        """The faults that strike before the call does its work."""
        fault = self.faults.get(call)
        if fault == "raise":
            raise RuntimeError(f"simulated failure in {call}")
        if fault == "hang":
            time.sleep(self.hang_seconds)
        if fault == "die":
            os._exit(DIE_CODE)

    def _after(self, call: str, value: Any) -> Any:
        """The faults that spoil what the call returns."""
        fault = self.faults.get(call)
        observation = value.observation if isinstance(value, Step) else value
        if fault in ("tall_image", "empty_image", "huge_image", "not_image"):
            observation = replace(observation, image=_bad_image(fault, self.screen))
            value = replace(value, observation=observation) if isinstance(value, Step) else observation
        elif fault in ("nan_reward", "inf_reward") and isinstance(value, Step):
            value = replace(value, reward=math.nan if fault == "nan_reward" else math.inf)
        elif fault == "wrong_type":
            value = ((observation, value.reward, value.done, value.info) if isinstance(value, Step)
                     else {"image": observation.image, "text": observation.text})
        return value


def _screen_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SCREENS:
        raise ValueError(f"screens must be a whole number from 1 to {MAX_SCREENS}, got {value!r}")
    return value
