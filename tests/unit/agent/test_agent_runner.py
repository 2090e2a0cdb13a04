"""Issue 50, items 1 and 9 at the environment boundary: environment classes loaded by name with named errors (the
reward loader's import code, shared), and hostile environments driven through ``EnvRunner`` in both isolation modes:
a hang ends ``env_timeout`` within the timeout (its worker killed under process isolation), a raise, a death, a wrong
type, a NaN reward and every screenshot the frame refuses end ``env_error`` naming the task, the call and the size;
G resets that differ are detected. The environments are the shipped simulator's test switches and small classes
written to files here, as a user would."""

from __future__ import annotations

import json
import math
import re
import time

import pytest
from PIL import Image

from llamafactory_qwenvl_patch.agent import Action, Observation, Step
from llamafactory_qwenvl_patch.agent.checks import (BoundaryError, check_observation, check_step, group_start_error,
                                                    json_value)
from llamafactory_qwenvl_patch.agent.loading import EnvLoadError, load_env_class
from llamafactory_qwenvl_patch.agent.runner import (ENV_ERROR, ENV_TIMEOUT, OK, EnvRunner, close_all, reset_all,
                                                    start_all, step_all)
from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.grpo.rewards.registry import load_reward

SIM = "qwenvl_prep.demos.gui_env:ClickThroughEnv"
FACTOR = FAMILIES["qwen3_vl"].factor
POLICY = ResizePolicy(32 * FACTOR * FACTOR, 64 * FACTOR * FACTOR, FACTOR)  # the GUI demo's frame
TASK = {"id": "login", "screens": 2, "platform": "laptop"}
TIMEOUT = 6.0  # a healthy call draws one 1280x800 screen: well under a second, even with 10 others on 2 cores
SLACK = 3.0  # what killing a hung worker (SIGTERM, join) and the other results may add to a timed-out call
ISOLATIONS = ["process", "inline"]


def runner(isolation: str, **kwargs) -> EnvRunner:
    return EnvRunner(SIM, {"hang_seconds": 60, **kwargs}, policy=POLICY, isolation=isolation, timeout=TIMEOUT)


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_environment_classes_load_by_name_with_named_errors(tmp_path):
    good = write(tmp_path, "good_env.py", "class Env:\n    def reset(self, task, seed): ...\n"
                 "    def step(self, action): ...\n    def close(self): ...\n\ndef make(): ...\n\n"
                 "class Half:\n    def reset(self, task, seed): ...\n\n"
                 "import abc\nclass Abstract(abc.ABC):\n    @abc.abstractmethod\n    def reset(self, task, seed): ...\n"
                 "    def step(self, action): ...\n    def close(self): ...\n")
    upper = write(tmp_path, "upper_env.PY", "class Env:\n    def reset(self, task, seed): ...\n"
                  "    def step(self, action): ...\n    def close(self): ...\n")
    assert load_env_class(f"{upper}:Env").__name__ == "Env"  # a .PY file is a file, not a module name
    assert load_env_class(f"{good}:Env").__name__ == "Env"
    assert load_env_class(SIM).__name__ == "ClickThroughEnv"
    raising = write(tmp_path, "raising_env.py", "import os\nraise RuntimeError('no display')\n")
    broken = write(tmp_path, "broken_env.py", "class Env:\n    def reset(self:\n")
    cases = {
        "qwenvl_no_such_env_module:Env": "module qwenvl_no_such_env_module not found",
        "qwenvl_prep.demos.no_such_env:Env": "module qwenvl_prep.demos.no_such_env not found",
        f"{tmp_path / 'missing.py'}:Env": f"file {tmp_path / 'missing.py'} not found",
        f"{good}:Nope": "good_env.py has no class Nope",
        f"{good}:make": "make is a function, not a class",
        f"{good}:Half": "class Half lacks step, close",
        f"{good}:Abstract": "class Abstract is abstract (it does not implement reset) and cannot be instantiated",
        "llamafactory_qwenvl_patch.agent:Environment": "Environment is a Protocol, the interface an environment "
                                                         "follows, and cannot be instantiated",
        f"{raising}:Env": "raising_env.py cannot be loaded: RuntimeError: no display (" + raising + ", line 2)",
        f"{broken}:Env": "broken_env.py cannot be loaded: SyntaxError",
        "just_a_module": "expected module:Class or path/to/env.py:Class",
        f"{good}:": "expected module:Class",
    }
    for spec, message in cases.items():
        with pytest.raises(EnvLoadError) as caught:
            load_env_class(spec)
        assert message in str(caught.value) and spec.strip() in str(caught.value), (spec, str(caught.value))
    # one import path for rewards and environments: the same failure reads the same
    with pytest.raises(ValueError, match=r"raising_env.py cannot be loaded: RuntimeError: no display \(.*line 2\)"):
        load_reward(f"{raising}:f")
    with pytest.raises(ValueError, match="module qwenvl_no_such_env_module not found"):
        load_reward("qwenvl_no_such_env_module:f")


def test_a_class_that_cannot_load_is_a_named_error_in_either_isolation(tmp_path):
    """Not an env_error per trajectory: inline at construction, in a worker at the first reset."""
    missing = f"{tmp_path / 'missing.py'}:Env"
    with pytest.raises(EnvLoadError, match="not found"):
        EnvRunner(missing, policy=POLICY, isolation="inline")
    with EnvRunner(missing, policy=POLICY, timeout=TIMEOUT) as slot, pytest.raises(EnvLoadError, match="not found"):
        slot.start()
    with EnvRunner(missing, policy=POLICY, timeout=TIMEOUT) as slot, pytest.raises(EnvLoadError, match="not found"):
        slot.reset(TASK, 0)  # started by its first reset
    with pytest.raises(ValueError, match="isolation 'thread' is not one of process, inline"):
        EnvRunner(SIM, policy=POLICY, isolation="thread")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        EnvRunner(SIM, policy=POLICY, timeout=math.inf)


STEP_FAULTS = {  # fault at step 1 -> (status, what the message says)
    None: (OK, ""),
    "hang": (ENV_TIMEOUT, "step 1: no answer within 6 s"),
    "raise": (ENV_ERROR, "step 1: raised RuntimeError: simulated failure in step1"),
    "wrong_type": (ENV_ERROR, "step 1: returned a tuple, not a Step"),
    "nan_reward": (ENV_ERROR, "step 1: the reward nan is not a finite number"),
    "inf_reward": (ENV_ERROR, "step 1: the reward inf is not a finite number"),
    "tall_image": (ENV_ERROR, "step 1: the screenshot for turn 2 is image size 1x5000 (WxH) has aspect ratio 5000.0"),
    "empty_image": (ENV_ERROR, "step 1: the screenshot for turn 2 is image size 0x0 (WxH) is empty"),
    "huge_image": (ENV_ERROR, "step 1: the screenshot for turn 2 is 10000x10000 (WxH) is 100,000,000 pixels"),
    "not_image": (ENV_ERROR, "step 1: the screenshot for turn 2 is a ndarray, not a PIL image"),
    "die": (ENV_ERROR, "step 1: its worker process died (exit code 3)"),
}


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_hostile_environments_step_in_parallel_and_end_by_name(isolation):
    """One healthy environment and one per fault step together: each ends as named, with the task, its seed and the
    call in the message; the hung one is given up at the timeout (its worker killed), so the whole step takes the
    timeout plus a little, not the hang; close() then runs where an instance is left, and the slot resets again."""
    faults = [f for f in STEP_FAULTS if isolation == "process" or f != "die"]  # `die` would end the test process
    slots = [runner(isolation, faults={"step1": f} if f else None) for f in faults]
    try:
        assert all(o.ok for o in start_all(slots))
        started = reset_all(slots, [TASK] * len(slots), [5] * len(slots))
        assert [o.status for o in started] == [OK] * len(slots), [o.message for o in started]
        begun = time.monotonic()
        outcomes = step_all(slots, [Action("click", 1.0, 1.0)] * len(slots))
        elapsed = time.monotonic() - begun
        assert elapsed < TIMEOUT + SLACK, elapsed
        for fault, outcome in zip(faults, outcomes):
            status, message = STEP_FAULTS[fault]
            assert outcome.status == status and message in outcome.message, (fault, outcome.message)
            assert outcome.status == OK or outcome.message.startswith(f"env {SIM}, task 'login' (seed 5), step 1")
        hung = outcomes[faults.index("hang")]
        assert TIMEOUT <= hung.seconds < TIMEOUT + SLACK
        assert ("worker process was killed" if isolation == "process" else "left running") in hung.message
        raised = outcomes[faults.index("raise")]
        assert "gui_env.py" in raised.traceback and "RuntimeError: simulated failure in step1" in raised.traceback
        assert isinstance(outcomes[0].value, Step) and outcomes[0].value.info["state_key"] == 0
        closed = close_all(slots)
        assert [o.status for o in closed] == [OK] * len(slots)
        gone = {"hang", "die"}
        assert all(("nothing to close" in o.message) == (f in gone) for f, o in zip(faults, closed))
        again = reset_all(slots[:2], [TASK] * 2, [5] * 2)  # the healthy slot and the hung one's, on a new worker
        assert [o.status for o in again] == [OK, OK]
        assert again[0].value == again[1].value
    finally:
        for slot in slots:
            slot.shutdown()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_reset_and_close_failures_end_by_name(isolation):
    cases = {
        "reset": {"raise": (ENV_ERROR, "reset: raised RuntimeError: simulated failure in reset"),
                  "hang": (ENV_TIMEOUT, "reset: no answer within 6 s"),
                  "wrong_type": (ENV_ERROR, "reset: returned a dict, not an Observation"),
                  "tall_image": (ENV_ERROR, "reset: the screenshot for turn 1 is image size 1x5000 (WxH)")},
        "close": {"raise": (ENV_ERROR, "close: raised RuntimeError: simulated failure in close"),
                  "hang": (ENV_TIMEOUT, "close: no answer within 6 s")},
    }
    if isolation == "inline":
        cases["reset"]["empty_image"] = (ENV_ERROR, "reset: the screenshot for turn 1 is image size 0x0 (WxH) is empty")
        cases["reset"]["not_image"] = (ENV_ERROR, "reset: the screenshot for turn 1 is a ndarray, not a PIL image")
    slots = {(call, fault): runner(isolation, faults={call: fault}) for call in cases for fault in cases[call]}
    try:
        assert all(o.ok for o in start_all(list(slots.values())))
        keys = list(slots)
        opened = reset_all([slots[k] for k in keys], [TASK] * len(keys), [0] * len(keys))
        ended = {key: outcome for key, outcome in zip(keys, opened) if key[0] == "reset"}
        assert all(o.status == OK for key, o in zip(keys, opened) if key[0] == "close")
        ended.update(zip([k for k in keys if k[0] == "close"], close_all([slots[k] for k in keys if k[0] == "close"])))
        for (call, fault), outcome in ended.items():
            status, message = cases[call][fault]
            assert outcome.status == status and message in outcome.message, (call, fault, outcome.message)
            assert f"task 'login' (seed 0), {call}" in outcome.message
    finally:
        for slot in slots.values():
            slot.shutdown()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_resets_of_a_group_that_differ_are_named(isolation):
    group = 3
    for nondeterministic, expected in ((False, None), (True, "task 'login': 2 of 3 resets with the same seed")):
        slots = [runner(isolation, nondeterministic_reset=nondeterministic) for _ in range(group)]
        try:
            start_all(slots)
            firsts = [o.value for o in reset_all(slots, [TASK] * group, [9] * group)]
            error = group_start_error(firsts, "'login'")
            assert error == expected if expected is None else expected in error
            if expected:
                assert "in their screenshot's pixels" in error and "deterministic in (task, seed)" in error
        finally:
            for slot in slots:
                slot.shutdown()
    image = Image.new("RGB", (40, 30), (1, 2, 3))
    texts = group_start_error([Observation(image, "a"), Observation(image.copy(), "b")], "'t'")
    assert "members 1, in their text" in texts
    resized = group_start_error([Observation(image), Observation(image.resize((30, 40)))], "'t'")
    assert "screenshot's size" in resized
    # palette images: the same indices, other colours (what the model sees differs)
    red, green = Image.new("P", (40, 30), 0), Image.new("P", (40, 30), 0)
    red.putpalette([255, 0, 0] + [0, 0, 0] * 255)
    green.putpalette([0, 255, 0] + [0, 0, 0] * 255)
    assert red.tobytes() == green.tobytes()
    assert "members 1, in their screenshot's pixels" in group_start_error([Observation(red), Observation(green)], "'t'")
    assert group_start_error([Observation(red), Observation(red.copy())], "'t'") is None


def test_values_that_cannot_cross_to_the_trainer_are_named(tmp_path):
    """A user environment that puts a lock, or an object of its own file's class, in ``info``: pickling fails in
    the worker, and the outcome says why instead of a traceback from multiprocessing."""
    spec = write(tmp_path, "unsendable_env.py", """
import threading
from PIL import Image
from llamafactory_qwenvl_patch.agent import Observation, Step

class Mine:
    pass

class Env:
    def __init__(self, what):
        self.what = what
    def reset(self, task, seed):
        return Observation(Image.new("RGB", (640, 480)), "start")
    def step(self, action):
        info = {"lock": threading.Lock()} if self.what == "lock" else {"mine": Mine()}
        return Step(Observation(Image.new("RGB", (640, 480))), 0.0, False, info)
    def close(self):
        pass
""") + ":Env"
    for what, message in (("lock", "cannot pickle '_thread.lock' object"), ("mine", "Mine")):
        with EnvRunner(spec, {"what": what}, policy=POLICY, timeout=TIMEOUT) as slot:
            assert slot.reset({"id": what}, 0).ok
            outcome = slot.step(Action("done"))
            assert outcome.status == ENV_ERROR and "step 1: returned a value that cannot be sent" in outcome.message
            assert message in outcome.message, outcome.message
            assert slot.close().ok


def test_what_a_step_returns_is_checked_by_name():
    """The checks behind the outcomes, on the values a careless environment returns."""
    screen = Observation(Image.new("RGB", (1280, 800)))
    assert check_step(Step(screen, 1, True, {"state_key": (2, "menu")}), POLICY, 2).reward == 1.0
    import numpy as np

    normalised = check_step(Step(screen, np.float32(0.5), np.bool_(True)), POLICY, 2)
    assert (type(normalised.reward), type(normalised.done)) == (float, bool)
    cases = [(Step(screen, "1", False), "the reward is a str, not a number"),
             (Step(screen, True, False), "the reward is a bool, not a number"),
             (Step(screen, np.bool_(True), False), "the reward is a bool, not a number"),
             (Step(screen, 10**400, False), "the reward is out of a float's range"),
             (Step(screen, 0.0, False, {1: "a", "1": "b"}), "info has a key that is not a str (int 1)"),
             (Step(screen, 0.0, "yes"), "done is a str, not a bool"),
             (Step(screen, 0.0, False, None), "info is a NoneType, not a dict"),
             (Step(screen, 0.0, False, {"state_key": ["menu"]}), "info['state_key'] is a list"),
             (Step(Observation(screen.image, None), 0.0, False), "the observation's text is a NoneType"),
             (Step(screen.image, 0.0, False), "returned a Image, not an Observation"),
             (Step(Observation(Image.new("La", (300, 200))), 0.0, False),
              "the screenshot for turn 3 is a 300x200 (WxH) image in mode La that cannot be read as RGB"),
             (Step(Observation(_cut_png()), 0.0, False), "image in mode RGB that cannot be read as RGB")]
    for step, message in cases:
        with pytest.raises(BoundaryError, match=re.escape(message)):
            check_step(step, POLICY, 3)


def _cut_png() -> Image.Image:
    """A PNG opened lazily, as an environment reading a file may return it, whose file is cut short."""
    import io

    data = io.BytesIO()
    Image.effect_noise((400, 300), 64).convert("RGB").save(data, "PNG")
    return Image.open(io.BytesIO(data.getvalue()[:len(data.getvalue()) // 2]))


def test_runner_misuse_is_a_clear_error():
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds up to"):
        EnvRunner(SIM, policy=POLICY, isolation="process", timeout=2.2e6)  # past what a pipe poll can wait
    slot = runner("inline")
    with pytest.raises(RuntimeError, match="no trajectory in progress"):
        slot.step(Action("done"))
    assert slot.reset(TASK, 1).ok
    with pytest.raises(RuntimeError, match="previous trajectory is not closed"):
        slot.reset(TASK, 1)
    slot.begin_step(Action("done"))
    with pytest.raises(RuntimeError, match="still in flight"):
        slot.begin_close()
    assert slot.result().value.done and slot.close().ok


FORGED_TEXTS = {  # observation text -> what the refusal names
    "Screen 2<|im_end|>\n": "holds '<|im_end|>', a token of the model's chat template",
    "look <|vision_start|>": "holds '<|vision_start|>', a token of the model's chat template",
    "pads <|image_pad|>": "holds '<|image_pad|>', a token of the model's chat template",
    "an <image> tag": "holds '<image>', LLaMA-Factory's image placeholder",
    "a <video>": "holds '<video>', LLaMA-Factory's video placeholder",
    "an <audio>": "holds '<audio>', LLaMA-Factory's audio placeholder",
    "a\ud800b": "is not encodable text (surrogates not allowed at character 1)",
}


def test_observation_text_the_renderer_cannot_take_is_refused_by_name():
    """Text is shown as text: a chat-template token would forge a turn or an image in the training row, a media
    placeholder would be expanded by LF's plugin, a lone surrogate cannot be tokenised. Each is an env_error at the
    boundary naming what it holds and the turn, whether reset or step returned it."""
    image = Image.new("RGB", (1280, 800))
    assert check_observation(Observation(image, "Press <Save> (2 of 3) \u00e9\U0001f600"), POLICY, 1).text
    for text, message in FORGED_TEXTS.items():
        with pytest.raises(BoundaryError) as caught:
            check_step(Step(Observation(image, text), 0.0, False), POLICY, 3)
        assert str(caught.value).startswith("the observation's text for turn 3 ") and message in str(caught.value)
        with pytest.raises(BoundaryError, match="text for turn 1"):
            check_observation(Observation(image, text), POLICY, 1)


def test_info_is_written_as_strict_json():
    """NaN and infinities as strings, values JSON cannot hold (a set, an object, a dict keyed by ints, a list that
    holds itself) as their repr, nested values kept in place: every row is valid JSON and nothing is dropped."""
    cycle = [1]
    cycle.append(cycle)
    info = {"score": math.nan, "best": [math.inf, -math.inf, 0.5], "seen": {1, 2}, "by_id": {1: "a", "1": "b"},
            "deep": {"ok": True, "n": 10**30, "none": None, "tuple": (1, "x")}, "cycle": cycle}
    value = json_value(info)
    assert json.loads(json.dumps(value, allow_nan=False)) == value
    assert value["score"] == "nan" and value["best"] == ["inf", "-inf", 0.5] and value["seen"] == "{1, 2}"
    assert value["by_id"] == "{1: 'a', '1': 'b'}"
    assert value["deep"] == {"ok": True, "n": 10**30, "none": None, "tuple": [1, "x"]}
    # numpy values as their Python values (np.False_ stays false); a lone surrogate, which no file takes, as its repr
    import numpy as np

    numbers = json_value({"success": np.bool_(False), "steps": np.int64(3), "score": np.float32(0.5),
                          "grid": np.arange(3), "nan": np.float64("nan"), "name": "a\ud800", "odd": {"\udc00": 1}})
    assert numbers == {"success": False, "steps": 3, "score": 0.5, "grid": [0, 1, 2], "nan": "nan",
                       "name": "'a\\ud800'", "odd": "{'\\udc00': 1}"}
    json.dumps(numbers, ensure_ascii=False).encode("utf-8")
    frame = json_value({"frame": np.zeros((64, 64, 3), np.uint8)})["frame"]  # an observation array: its summary
    assert isinstance(frame, str) and frame.startswith("array(") and len(frame) < 1000
