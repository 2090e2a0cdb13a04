"""Issue 50, item 6: the shipped simulated GUI environment, driven through ``EnvRunner`` as the trainer will drive
it. Screens are deterministic by (task, seed) at real screenshot sizes; a scripted agent that answers each turn in
that turn's model frame (mapped back by ``agent.frame``) clicks through every screen, also when the screen changes
size mid-episode, while one that answers in screen pixels, or maps with an earlier turn's size, does not; the text
readers pass a turn on a letter; the rewards are 1 on the last pass and 0 otherwise."""

from __future__ import annotations

import functools
import json

import pytest

from llamafactory_qwenvl_patch.agent import Action, Observation
from llamafactory_qwenvl_patch.agent.frame import read_action, screenshot_size
from llamafactory_qwenvl_patch.agent.runner import EnvRunner
from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from qwenvl_prep.demos.gui import SCREENS
from qwenvl_prep.demos.gui_env import FAULTS, ClickThroughEnv, draw_task_screen

SIM = "qwenvl_prep.demos.gui_env:ClickThroughEnv"
SCREENS_PER_TASK = 4


def policy_of(family: str) -> ResizePolicy:
    factor = FAMILIES[family].factor
    return ResizePolicy(32 * factor * factor, 64 * factor * factor, factor)  # the GUI demo's bounds


def test_screens_are_deterministic_by_task_and_seed_at_real_sizes():
    task = {"id": "settings", "screens": SCREENS_PER_TASK}
    first = draw_task_screen(task, 3, 0)
    again = draw_task_screen(dict(reversed(list(task.items()))), 3, 0)  # key order does not matter
    assert first.image.tobytes() == again.image.tobytes() and (first.label, first.box) == (again.label, again.box)
    assert draw_task_screen(task, 4, 0).image.tobytes() != first.image.tobytes()
    assert draw_task_screen(task, 3, 1).image.tobytes() != first.image.tobytes()
    assert first.image.size == SCREENS[first.platform] and first.image.mode == "RGB"
    x1, y1, x2, y2 = first.box
    assert 0 <= x1 < x2 <= first.image.width and 0 <= y1 < y2 <= first.image.height
    phone = draw_task_screen({"platform": "phone"}, 0, 0)
    assert phone.image.size == (1170, 2532)
    sizes = {draw_task_screen({"platform": "phone"}, 0, i, change_size=True).image.size for i in range(4)}
    assert sizes == set(SCREENS.values())
    with pytest.raises(ValueError, match="task platform 'watch' is not one of desktop, laptop, phone, tablet"):
        draw_task_screen({"platform": "watch"}, 0, 0)
    env = ClickThroughEnv()
    observation = env.reset(task, 3)
    assert observation.text == f"Screen 1 of {SCREENS_PER_TASK}: press {first.label}."
    assert observation.image.tobytes() == first.image.tobytes()


@functools.lru_cache(maxsize=None)
def _target(task: str, seed: int, index: int, change_size: bool) -> tuple[int, int, int, int]:
    return draw_task_screen(json.loads(task), seed, index, change_size=change_size).box


def target_box(task: dict, seed: int, index: int, change_size: bool) -> tuple[int, int, int, int]:
    """The box of the control to press on a screen, drawn once per test session."""
    return _target(json.dumps(task, sort_keys=True), seed, index, change_size)


def model_frame_agent(observation: Observation, index: int, task: dict, seed: int, policy: ResizePolicy,
                      convention: str, change_size: bool) -> str:
    """A perfect agent: the control of the screen it is shown, as the model sees it (its box mapped into this
    screenshot's model frame), clicked at its centre in whole numbers. It knows the layout from the simulator's
    drawing function; it sees the screenshot's size only through the observation."""
    target = target_box(task, seed, index, change_size)
    orig_hw, model_hw = screenshot_size(observation.image, policy)
    x1, y1, x2, y2 = convert_coords(target, "orig", convention, orig_hw, model_hw, ndigits=None)
    return json.dumps({"action": "click", "point_2d": [round((x1 + x2) / 2), round((y1 + y2) / 2)]})


def play(slot: EnvRunner, task: dict, seed: int, policy: ResizePolicy, convention: str, change_size: bool,
         mapping: str) -> tuple[list[float], list[tuple[int, int]], bool, int]:
    """One episode of the scripted agent; ``mapping``: ``turn`` (each answer mapped with the sizes of the screenshot
    it answered), ``first`` (with the first turn's: stale) or ``pixels`` (the agent answers the control's centre in
    screen pixels instead of its model frame). Returns the rewards, each turn's screenshot size, done and the screens
    passed."""
    observation, index = slot.reset(task, seed).value, 0
    first_sizes = screenshot_size(observation.image, policy)
    rewards, sizes, done = [], [], False
    for _ in range(SCREENS_PER_TASK):
        sizes.append(observation.image.size)
        orig_hw, model_hw = first_sizes if mapping == "first" else screenshot_size(observation.image, policy)
        if mapping == "pixels":
            x1, y1, x2, y2 = target_box(task, seed, index, change_size)
            answer = json.dumps({"action": "click", "point_2d": [round((x1 + x2) / 2), round((y1 + y2) / 2)]})
        else:
            answer = model_frame_agent(observation, index, task, seed, policy, convention, change_size)
        outcome = slot.step(read_action(answer, convention, orig_hw, model_hw))
        assert outcome.ok, outcome.message
        observation, index, done = outcome.value.observation, outcome.value.info["state_key"], outcome.value.done
        rewards.append(outcome.value.reward)
        if done:
            break
    assert slot.close().ok
    return rewards, sizes, done, index


@pytest.mark.parametrize("isolation, families", [("inline", sorted(FAMILIES)), ("process", ["qwen3_vl"])],
                         ids=["inline", "process"])
def test_an_agent_answering_each_turn_in_its_model_frame_clicks_through_on_every_family(isolation, families):
    """Every family, every turn on its own screen size (change_size: phone, tablet, desktop, laptop): all clicks
    land, reward 1 on the last screen only (one family under process isolation: the same mapping, the values
    crossing processes). Answers in screen pixels miss every screen; answers mapped with the
    first turn's sizes pass the first screen, then miss on a screen of another size and stay there (controls are
    large, so a stale mapping can still land on some)."""
    task, seed = {"id": "checkout", "screens": SCREENS_PER_TASK, "platform": "phone"}, 11
    for family in families:
        policy, convention = policy_of(family), FAMILIES[family].coords
        with EnvRunner(SIM, {"change_size": True}, policy=policy, isolation=isolation, timeout=30) as slot:
            rewards, sizes, done, passed = play(slot, task, seed, policy, convention, True, "turn")
            assert rewards == [0.0] * (SCREENS_PER_TASK - 1) + [1.0] and done and passed == SCREENS_PER_TASK, family
            assert len(set(sizes)) == SCREENS_PER_TASK, sizes
            rewards, _, done, passed = play(slot, task, seed, policy, convention, True, "pixels")
            assert rewards == [0.0] * SCREENS_PER_TASK and not done and passed == 0, family
            rewards, _, done, passed = play(slot, task, seed, policy, convention, True, "first")
            assert rewards == [0.0] * SCREENS_PER_TASK and not done and 1 <= passed < SCREENS_PER_TASK, family


def test_one_size_per_task_without_change_size_and_the_rewards_sum_to_success():
    policy, convention = policy_of("qwen2_5_vl"), "model"
    task = {"id": "plain", "screens": SCREENS_PER_TASK}
    with EnvRunner(SIM, policy=policy, isolation="inline") as slot:
        rewards, sizes, done, _ = play(slot, task, 2, policy, convention, False, "turn")
    assert sum(rewards) == 1.0 and done and len(set(sizes)) == 1


def test_misses_other_actions_and_done_leave_or_end_the_episode():
    env = ClickThroughEnv(screens=2)
    observation = env.reset({"id": "t"}, 0)
    for action in (Action("click", 0.0, 0.0), Action("type", text="Save"), Action("scroll", 5.0, 5.0, direction="up"),
                   Action("key", key="enter"), Action("invalid", raw="?", reason="no action")):
        step = env.step(action)
        assert (step.reward, step.done, step.info) == (0.0, False, {"state_key": 0, "passed": False})
        assert step.observation.image.tobytes() == observation.image.tobytes()
    step = env.step(Action("done"))
    assert (step.reward, step.done, step.info["state_key"]) == (0.0, True, 0)
    with pytest.raises(RuntimeError, match="the episode has ended"):
        env.step(Action("done"))


@pytest.mark.parametrize("reader", ["text", "raw"])
def test_the_text_readers_pass_a_turn_on_a_letter(reader):
    """The learning test's rule (agents.md 9.6): two turns, each passed by an action containing the letter; ``text``
    reads a type action's text, ``raw`` the model's whole answer (an untrained model writes no JSON)."""
    env = ClickThroughEnv(screens=2, reader=reader, letter="e")
    assert env.reset({"id": "letters"}, 1).text == "Screen 1 of 2: type a word."
    if reader == "text":  # the text reader reads the text alone: "type" in the raw answer has an e
        miss, hit = (Action("type", text=word, raw=f'{{"action": "type", "text": "{word}"}}') for word in ("dog", "hen"))
    else:
        miss, hit = (Action("invalid", raw=word, reason="no action") for word in ("dog", "yes"))
    steps = [env.step(action) for action in (miss, hit, hit)]
    assert [(s.reward, s.done, s.info["state_key"]) for s in steps] == [(0.0, False, 0), (0.0, False, 1),
                                                                       (1.0, True, 2)]
    if reader == "text":  # a click never passes a text turn, even on the letter in its raw text
        env.reset({"id": "letters"}, 1)
        assert env.step(Action("click", 1.0, 1.0, raw='{"action": "click", "point_2d": [1, 1]} e')).info["passed"] is False


def test_the_switches_are_checked_by_name():
    with pytest.raises(ValueError, match="calls are reset, step1, step2, ..., close; faults are raise, hang"):
        ClickThroughEnv(faults={"step0": "raise"})
    with pytest.raises(ValueError, match="'explode'"):
        ClickThroughEnv(faults={"step1": "explode"})
    with pytest.raises(ValueError, match="reader 'voice' is not one of click, text, raw"):
        ClickThroughEnv(reader="voice")
    with pytest.raises(ValueError, match="screens must be a whole number from 1 to 100, got 0"):
        ClickThroughEnv().reset({"screens": 0}, 0)
    assert set(FAULTS) >= {"raise", "hang", "die", "wrong_type", "nan_reward", "tall_image", "empty_image",
                           "huge_image", "not_image"}
