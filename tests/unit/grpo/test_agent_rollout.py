"""Multi-turn agent rollouts without a model's sampling: scripted actions (token ids) through ``run_episodes`` with
the shipped simulator and LF's template. Clicks written at the named control's centre in the model's frame reach
every screen on every family, screens changing size mid-episode; the same points written in screen pixels miss on
every resized screen. The training rows of trajectories of different lengths, batched and left-padded, give each
action token the log-prob its row gives alone, and the mask is exactly the action tokens. Failed trajectories leave
their group's baseline; the agent rewards, the trie number and the YAML keys' rules."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
from helpers import text_env
from test_agent_turns import ACTIONS, FIXTURES, PROMPT, SCREENS, play, renderer, screenshot

from llamafactory_qwenvl_patch.agent.frame import answer_text
from llamafactory_qwenvl_patch.agent.runner import EnvRunner
from llamafactory_qwenvl_patch.agent.types import Action
from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model
from llamafactory_qwenvl_patch.frame.mrope import pin_pretrained_positions
from llamafactory_qwenvl_patch.grpo.generation.agent_episodes import (
    DONE,
    TURNS,
    Episode,
    EpisodeSettings,
    Task,
    run_episodes,
    trie_saving,
)
from llamafactory_qwenvl_patch.grpo.rewards.agent import action_format_reward, env_reward
from llamafactory_qwenvl_patch.grpo.rollout import shared_prefix
from llamafactory_qwenvl_patch.grpo.rollout.agent_rows import (
    ACTION_INDEX,
    action_values,
    packed_trajectory_inputs,
    suffix_values,
    trajectory_inputs,
)
from llamafactory_qwenvl_patch.grpo.trainer import agent_phase
from llamafactory_qwenvl_patch.grpo.trainer.agent_phase import AgentMixin, _agent_metrics, _leave_failures_out
from llamafactory_qwenvl_patch.grpo.trainer.state import RunState
from llamafactory_qwenvl_patch.grpo.trainer.step import StepMixin
from qwenvl_prep.demos.gui_env import ClickThroughEnv, draw_task_screen

ENV = "qwenvl_prep.demos.gui_env:ClickThroughEnv"
TASKS = [{"id": "phone-first", "screens": 3, "platform": "phone"}, {"id": "desktop-first", "screens": 3,
                                                                   "platform": "desktop"}]
G = 2


def click_sampler(r, tasks, seeds, convention, in_model_frame=True):
    """A scripted agent: on each row (its turn is its number of screenshots) it clicks the centre of the control the
    screen names, written in the model's frame through that screenshot's sizes, or (``in_model_frame=False``) as
    the screen's own pixels, the mistake the frame exists to prevent."""
    stop, tok = r.stop_id, r.tokenizer
    firsts = [draw_task_screen(task, seed, 0, change_size=True).image for task, seed in zip(tasks, seeds)]
    firsts = [r.policy.model_size(image.height, image.width) for image in firsts]
    assert len(set(firsts)) == len(firsts)  # a row's task is told by its first screenshot's frame

    def sample(rows, images, _positions):
        ids, texts = [], []
        for row, shots in zip(rows, images):
            task = firsts.index((shots[0].height, shots[0].width))
            screen = draw_task_screen(tasks[task], seeds[task], len(shots) - 1, change_size=True)
            x1, y1, x2, y2 = screen.box
            centre = ((x1 + x2) / 2, (y1 + y2) / 2)
            orig_hw = (screen.image.height, screen.image.width)
            model_hw = r.policy.model_size(*orig_hw)
            if in_model_frame:
                text = answer_text(Action("click", *centre), convention, orig_hw, model_hw)
            else:
                text = '{"action": "click", "point_2d": [%d, %d]}' % centre
            texts.append(text)
            ids.append(tok.encode(text, add_special_tokens=False) + [stop])
        return ids, [True] * len(rows), texts, None

    return sample


def episodes_of(r, sampler, tasks, seeds, convention, max_turns=4):
    runners = [EnvRunner(ENV, {"change_size": True}, policy=r.policy, isolation="inline", timeout=30)
               for _ in range(len(tasks) * G)]
    settings = EpisodeSettings(r.policy, convention, max_turns, 16384, 48)
    named = [Task(t, PROMPT, None, None, t["id"]) for t in tasks]
    return run_episodes(named, G, runners, seeds, r, sampler, settings)


@pytest.mark.parametrize("family", list(FIXTURES))
def test_clicks_in_the_model_frame_reach_every_screen(request, family):
    model_dir = request.getfixturevalue(FIXTURES[family])
    r = renderer(model_dir)
    convention = FAMILIES[family_of_model(model_dir)].coords
    seeds = [11, 12]
    sizes = [{draw_task_screen(t, s, i, change_size=True).image.size for i in range(3)} for t, s in zip(TASKS, seeds)]
    assert all(len(s) == 3 for s in sizes)  # the screen changes size on every turn
    right = episodes_of(r, click_sampler(r, TASKS, seeds, convention), TASKS, seeds, convention)
    assert [e.end for e in right] == [DONE] * 4 and env_reward([], trajectories=[e.record() for e in right]) == [1.0] * 4
    for e in right:
        assert len(e.turns) == 3 and len({tuple(t["orig_hw"]) for t in e.turns}) == 3
        for turn in e.turns:  # each action was mapped back through its own turn's sizes
            assert tuple(turn["model_hw"]) == r.policy.model_size(*turn["orig_hw"])
            assert turn["info"]["passed"] is True
        assert not e.failed and e.trajectory.images and len(e.trajectory.images) == 2
    wrong = episodes_of(r, click_sampler(r, TASKS, seeds, convention, in_model_frame=False), TASKS, seeds,
                        convention, max_turns=2)
    assert [e.end for e in wrong] == [TURNS] * 4  # screen pixels sent as model-frame numbers: every screen missed
    assert all(t["info"]["passed"] is False for e in wrong for t in e.turns)


def test_a_rank_whose_trajectories_ended_joins_each_tensor_parallel_call_empty(tiny_model):
    """Under a tensor-parallel engine every call is a collective: told that another rank still has a live
    trajectory, a rank whose own have ended keeps calling the sampler with no request, turn by turn, until no rank
    has one; its episodes are unchanged by it."""
    r = renderer(tiny_model)
    seeds, convention = [11, 12], FAMILIES["qwen2_5_vl"].coords
    sampler = click_sampler(r, TASKS, seeds, convention)
    calls, others = [], iter([True, True, True, True, True, False])  # the other rank: live for five turns

    def recorded(rows, images, tasks):
        calls.append(len(rows))
        return sampler(rows, images, tasks) if rows else ([], [], [], [])

    def in_step(live):
        return next(others) or live

    runners = [EnvRunner(ENV, {"change_size": True}, policy=r.policy, isolation="inline", timeout=30)
               for _ in range(len(TASKS) * G)]
    named = [Task(t, PROMPT, None, None, t["id"]) for t in TASKS]
    episodes = run_episodes(named, G, runners, seeds, r, recorded, EpisodeSettings(r.policy, convention, 4, 16384, 48),
                            in_step)
    assert calls == [4, 4, 4, 0, 0]  # three turns of its own, then two calls joined empty
    assert [e.end for e in episodes] == [DONE] * 4 and all(len(e.turns) == 3 for e in episodes)


def _action_logps(model, inputs, targets):
    trainer = types.SimpleNamespace(suppressed=[], temperature=1.0)
    return StepMixin._token_logps(trainer, model, inputs, targets)[0]


def test_trajectory_rows_batched_give_each_row_its_own_logps(tiny_model):
    """Two trajectories of different lengths and screen sizes in one left-padded batch: every action token's
    log-prob equals its row's alone (explicit positions, logits only at the action index), and the targets under
    the mask are exactly the action tokens in order."""
    from transformers import AutoModelForImageTextToText

    r = renderer(tiny_model)
    tok = r.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(tiny_model).eval()
    pin_pretrained_positions(model)
    shots = [screenshot(w, h, seed) for seed, (w, h) in enumerate(SCREENS)]
    model_shots = [s.resize(r.policy.model_size(s.height, s.width)[::-1]) for s in shots]
    actions = [tuple(tok.encode(text, add_special_tokens=False)) + (r.stop_id,) for text in ACTIONS]
    rows = []
    for count in (3, 1):
        root, trajectory = play(r, actions[:count], model_shots[:count])
        ids, mask = trajectory.rows()
        rows.append((list(root.ids) + ids, [0] * len(root.ids) + mask, [*root.images, *trajectory.images]))
    with torch.no_grad():
        inputs, targets, mask = trajectory_inputs(model, rows, r.processor.image_processor, tok.pad_token_id)
        batched = _action_logps(model, inputs, targets)
        for b, row in enumerate(rows):
            alone, alone_targets, alone_mask = trajectory_inputs(model, [row], r.processor.image_processor,
                                                                 tok.pad_token_id)
            single = _action_logps(model, alone, alone_targets)
            assert alone_targets[alone_mask.bool()].tolist() == [t for i, t in enumerate(row[0]) if row[1][i]]
            assert torch.allclose(batched[b][mask[b].bool()], single[0][alone_mask[0].bool()], atol=1e-5)
    expected = [[t for a in actions[:3] for t in a], list(actions[0])]
    assert [targets[b][mask[b].bool()].tolist() for b in range(2)] == expected
    assert inputs[ACTION_INDEX].numel() == mask.size(1) < inputs["input_ids"].size(1) // 4  # logits kept: actions only
    assert torch.isfinite(batched[mask.bool()]).all()
    assert torch.isfinite(batched).all()  # masked places are finite too (a -inf would make the KL NaN)


def test_a_micro_batch_without_a_screenshot_runs_the_vision_tower_on_a_masked_dummy(tiny_model):
    """Under ZeRO-3 a rank whose every task failed at reset still runs the vision tower (its weights are gathered by
    all ranks together): the first failed row or rootless group holds a blank screenshot, masked, in both layouts;
    the forward runs the vision tower on it (hooked), and no position is trained."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    r = renderer(tiny_model)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model).eval()
    pin_pretrained_positions(model)
    shared_prefix.install(model)
    h, w = r.policy.model_size(r.policy.factor, r.policy.factor)
    config = model.config
    dummy = ([config.vision_start_token_id, *[config.image_token_id] * r.policy.image_tokens(h, w),
              config.vision_end_token_id], Image.new("RGB", (w, h), (128, 128, 128)))
    pad, processor = r.tokenizer.pad_token_id, r.processor.image_processor
    ran = []
    model.model.visual.register_forward_hook(lambda *args: ran.append(True))
    plain, plain_targets, plain_mask = trajectory_inputs(model, [([], [], [])] * 2, processor, pad, dummy)
    packed, packed_targets, packed_mask, _ = packed_trajectory_inputs(
        model, [([], [], [([], [], [])] * 3)] * 2, processor, pad, 3, dummy)
    for inputs, targets, mask in ((plain, plain_targets, plain_mask), (packed, packed_targets, packed_mask)):
        assert inputs["image_grid_thw"].tolist() == [[1, h // r.policy.patch_size, w // r.policy.patch_size]]
        assert not mask.any()
        context = shared_prefix.attention_active([model]) if shared_prefix.KWARG in inputs else torch.no_grad()
        with context, torch.no_grad():
            assert torch.isfinite(_action_logps(model, inputs, targets)).all()
    assert len(ran) == 2
    assert "pixel_values" not in trajectory_inputs(model, [([], [], [])], processor, pad)[0]  # no dummy asked


def _logps_and_grads(model, inputs, targets, mask, weights):
    model.zero_grad()
    context = shared_prefix.attention_active([model]) if shared_prefix.KWARG in inputs else torch.enable_grad()
    with context:
        logps = _action_logps(model, inputs, targets)
        (logps * mask * weights).sum().backward()
    return logps.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FIXTURES))
def test_a_packed_group_equals_one_row_per_trajectory(request, family):
    """Two tasks of G 3 packed behind their roots (the first screenshot once per task; one member failed at reset,
    one of a single turn, the others of 2-3 turns with screenshots of other sizes): every action token's log-prob
    and the gradient of a weighted sum of them equal those of one row per trajectory (fp32: 1e-5; gradients
    relative 1e-4), the targets under the mask are exactly the same action tokens, and the sampler's values land
    on the same tokens."""
    from test_grpo_shared_prefix import assert_close_grads
    from transformers import AutoModelForImageTextToText

    model_dir = request.getfixturevalue(FIXTURES[family])
    r = renderer(model_dir)
    tok = r.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    model.train()
    pin_pretrained_positions(model)
    shared_prefix.install(model)
    shots = [screenshot(w, h, seed) for seed, (w, h) in enumerate(SCREENS)]
    model_shots = [s.resize(r.policy.model_size(s.height, s.width)[::-1]) for s in shots]
    actions = [tuple(tok.encode(text, add_special_tokens=False)) + (r.stop_id,) for text in ACTIONS]
    plan = [[((0, 1, 2), (0, 1, 2)), ((1,), (0,)), None],  # (actions, screenshots) of each member; None: no root
            [((2, 0), (2, 1)), ((0, 1, 2), (2, 0, 1)), ((1, 0), (2, 2))]]
    rows, groups, values = [], [], []
    for task in plan:
        members = []
        for member in task:
            if member is None:
                rows.append(([], [], []))
                members.append(([], [], []))
                values.append([])
                continue
            root, trajectory = play(r, [actions[a] for a in member[0]], [model_shots[i] for i in member[1]])
            ids, mask = trajectory.rows()
            rows.append((list(root.ids) + ids, [0] * len(root.ids) + mask, [*root.images, *trajectory.images]))
            members.append((ids, mask, list(trajectory.images)))
            values.append([float(i) if m else 0.0 for i, m in enumerate(mask)])
        groups.append((list(root.ids), list(root.images), members))
    processor, pad = r.processor.image_processor, tok.pad_token_id
    plain, plain_targets, plain_mask = trajectory_inputs(model, rows, processor, pad)
    packed, targets, mask, index = packed_trajectory_inputs(model, groups, processor, pad, 3)
    assert packed["pixel_values"].size(0) == plain["pixel_values"].size(0) - sum(
        grid.prod() for grid in plain["image_grid_thw"][[3, 6, 9]])  # the roots' screenshots once per task
    for b in range(6):
        assert targets[b][mask[b].bool()].tolist() == plain_targets[b][plain_mask[b].bool()].tolist()
    assert [targets[b][mask[b].bool()].tolist() for b in (0, 1, 2)] == [
        [t for a in (0, 1, 2) for t in actions[a]], list(actions[1]), []]
    sampled = suffix_values(values, packed[shared_prefix.KWARG].completion_length, index)
    assert all(sampled[b][mask[b].bool()].tolist() == [float(i) for i, m in enumerate(rows[b][1][len(rows[b][1])
               - len(groups[b // 3][2][b % 3][1]):]) if m] for b in range(6) if rows[b][0])
    weights = torch.linspace(-1.0, 2.0, 6).unsqueeze(1)
    plain_logps, plain_grads = _logps_and_grads(model, plain, plain_targets, plain_mask, weights)
    packed_logps, packed_grads = _logps_and_grads(model, packed, targets, mask, weights)
    for b in range(6):
        assert torch.allclose(packed_logps[b][mask[b].bool()], plain_logps[b][plain_mask[b].bool()], atol=1e-5)
    assert torch.isfinite(packed_logps).all()
    assert_close_grads(packed_grads, plain_grads)


@pytest.mark.parametrize("family", list(FIXTURES))
def test_hf_generation_of_left_padded_turns_equals_each_row_alone(request, family):
    """The HF sampler of an agent run (``AgentMixin._agent_sampler``) generates on whole rows, left-padded to one
    width with every row's screenshots, and lets the model number the positions (every row starts at its task's
    root): a turn-1 row and a turn-3 row (screens of three sizes) batched give each the greedy tokens and logits it
    gets alone."""
    from transformers import AutoModelForImageTextToText

    from llamafactory_qwenvl_patch.agent.frame import model_screen

    model_dir = request.getfixturevalue(FIXTURES[family])
    r = renderer(model_dir)
    tok, pad = r.tokenizer, r.tokenizer.pad_token_id
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    if FAMILIES[family].video_clock != "stamps":
        pin_pretrained_positions(model)  # as the plugin loads Qwen2/2.5-VL
    action = tuple(tok.encode('{"action": "done"}', add_special_tokens=False) + [r.stop_id])
    shots = [model_screen(s, r.policy).image for s in (screenshot(640, 480, 1), screenshot(300, 900, 2),
                                                          screenshot(1000, 400, 3))]
    rows, images = [], []
    for turns in (1, 3):
        root, trajectory = play(r, [action] * turns, shots[:turns])
        rows.append(list(root.ids) + trajectory.rows()[0][:-len(action)])  # the prompt of action ``turns``
        images.append([*root.images, *trajectory.images][:turns])

    def generate(batch_rows, batch_images):
        width = max(len(row) for row in batch_rows)
        batch = {"input_ids": torch.tensor([[pad] * (width - len(row)) + row for row in batch_rows]),
                 "attention_mask": torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in batch_rows])}
        visual = r.processor.image_processor(images=[i for row in batch_images for i in row], return_tensors="pt")
        batch.update(pixel_values=visual["pixel_values"], image_grid_thw=visual["image_grid_thw"])
        with torch.no_grad():
            return model.generate(**batch, max_new_tokens=6, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)

    both, width = generate(rows, images), max(len(row) for row in rows)
    for k in range(2):
        alone = generate([rows[k]], [images[k]])
        new = len(alone.scores)  # a row that stops early is padded in the batch after its stop token
        assert both.sequences[k, width:width + new].tolist() == alone.sequences[0, len(rows[k]):].tolist()
        assert max((both.scores[t][k] - alone.scores[t][0]).abs().max() for t in range(new)) < 1e-4


def test_step_values_land_on_their_own_actions_tokens(tiny_model):
    """GiGPO's per-step advantages reach the loss as per-token values: each action's value on exactly that action's
    tokens, in the packed layout and in one row per trajectory (a trajectory failed at reset has none)."""
    from llamafactory_qwenvl_patch.grpo.generation.agent_episodes import Episode
    from llamafactory_qwenvl_patch.grpo.trainer.agent_phase import _token_values
    from transformers import AutoModelForImageTextToText

    r = renderer(tiny_model)
    tok = r.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(tiny_model)
    pin_pretrained_positions(model)
    shots = [screenshot(w, h, seed) for seed, (w, h) in enumerate(SCREENS)]
    model_shots = [s.resize(r.policy.model_size(s.height, s.width)[::-1]) for s in shots]
    actions = [tuple(tok.encode(text, add_special_tokens=False)) + (r.stop_id,) for text in ACTIONS]
    episodes = []
    for plan in ((0, 1, 2), (2,), None):
        if plan is None:
            episodes.append(Episode(0))
            continue
        root, trajectory = play(r, [actions[a] for a in plan], model_shots[:len(plan)])
        episodes.append(Episode(0, root=root, trajectory=trajectory))
    per_action = [[10.0, 20.0, 30.0], [40.0], []]
    values = [_token_values(e, v) for e, v in zip(episodes, per_action)]
    expected = [[10.0] * len(actions[0]) + [20.0] * len(actions[1]) + [30.0] * len(actions[2]),
                [40.0] * len(actions[2]), []]
    processor, pad = r.processor.image_processor, tok.pad_token_id
    members = [(*e.trajectory.rows(), list(e.trajectory.images)) if e.root else ([], [], []) for e in episodes]
    _, _, mask, index = packed_trajectory_inputs(model, [(list(episodes[0].root.ids), list(episodes[0].root.images),
                                                          members)], processor, pad, 3)
    packed = suffix_values(values, int(max(len(v) for v in values)), index)
    assert [packed[b][mask[b].bool()].tolist() for b in range(3)] == expected
    rows = [(list(e.root.ids) + e.trajectory.rows()[0], [0] * len(e.root.ids) + e.trajectory.rows()[1],
             [*e.root.images, *e.trajectory.images]) if e.root else ([], [], []) for e in episodes]
    inputs, _, row_mask = trajectory_inputs(model, rows, processor, pad)
    roots = [len(e.root.ids) if e.root else 0 for e in episodes]
    plain = action_values([[0.0] * n + v if v else [] for n, v in zip(roots, values)], inputs["input_ids"].size(1),
                          inputs[ACTION_INDEX])
    assert [plain[b][row_mask[b].bool()].tolist() for b in range(3)] == expected


def test_a_failed_trajectory_leaves_its_groups_baseline():
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.5, 2.0, 3.0, 9.0, 1.0])
    failed = torch.tensor([False, False, True, False, True, True, True, False])
    baseline, usable = _leave_failures_out(rewards, failed, 4)
    first = baseline[:4]
    assert first[2] == pytest.approx((1.0 + 0.0 + 0.5) / 3) and first.mean() == pytest.approx(0.5)
    assert usable.tolist() == [True, True, False, True, False, False, False, False]  # group 2: one usable member


def test_the_logged_reward_statistics_are_the_losss_view():
    """A group whose usable members agree reads as flat even where its failed members scored otherwise, a group with
    one usable member (no loss) is left out of the statistics, and a rollout where no group gets a loss logs every
    trajectory as scored."""
    from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta
    from llamafactory_qwenvl_patch.grpo.trainer.agent_phase import _logged_stats

    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0])
    failed = torch.tensor([False, False, True, True, False, True, True, True])
    baseline, usable = _leave_failures_out(rewards, failed, 4)
    meta = [SampleMeta(k, "task", "", None) for k in range(2)]
    lengths, stopped = torch.full((8,), 5.0), torch.ones(8, dtype=torch.bool)
    stats = _logged_stats(rewards, baseline, usable, lengths, stopped, ["x"] * 8, meta, 4)
    assert (stats["reward"], stats["reward_std"], stats["frac_reward_zero_std"]) == (1.0, 0.0, 1.0)
    none = torch.zeros(8, dtype=torch.bool)
    scored = _logged_stats(rewards, baseline, none, lengths, stopped, ["x"] * 8, meta, 4)
    assert scored["reward"] == pytest.approx(0.5) and scored["frac_reward_zero_std"] == 0.0


def test_evaluation_plays_each_task_on_the_same_screens_at_every_evaluation():
    """Training seeds move with the micro-step (every rollout new screens); an evaluation's come from the run's seed
    and the record alone, on any rank at any step, so evaluations compare checkpoints on the same tasks."""
    from types import SimpleNamespace

    from llamafactory_qwenvl_patch.grpo.trainer.agent_play import AgentPlayMixin

    trainer = SimpleNamespace(args=SimpleNamespace(seed=7, process_index=0), run_state=SimpleNamespace(micro_step=0))
    seed = AgentPlayMixin._agent_seed
    evaluation, training = [seed(trainer, k, None) for k in range(4)], seed(trainer, 0, 0)
    trainer.run_state.micro_step, trainer.args.process_index = 5, 1
    assert [seed(trainer, k, None) for k in range(4)] == evaluation and len(set(evaluation)) == 4
    assert seed(trainer, 0, 0) != training


class ScriptedRefill:
    """The trainer's agent refill (``AgentMixin._agent_refill`` with its flat rule and ``RefillMixin``'s rank vote)
    over scripted rollouts: each dataset task's G trajectories get the rewards and failures of ``TABLE[task]``
    (sampling and scoring are the table; the swaps, the draws and the bookkeeping are the trainer's)."""

    from llamafactory_qwenvl_patch.grpo.trainer.agent_phase import AgentMixin
    from llamafactory_qwenvl_patch.grpo.trainer.refill import RefillMixin
    from llamafactory_qwenvl_patch.grpo.trainer.rollout_phase import RolloutMixin

    _agent_refill, _agent_flat, _scored_tasks = (AgentMixin._agent_refill, AgentMixin._agent_flat,
                                                 AgentMixin._scored_tasks)
    _any_rank, _weighted_total = RefillMixin._any_rank, RolloutMixin._weighted_total

    def __init__(self, table: dict[int, list[float | None]], max_resample: int):
        from llamafactory_qwenvl_patch.grpo.rewards.registry import Reward
        from llamafactory_qwenvl_patch.grpo.trainer.state import RunState

        self.table, self.num_generations, self.steps_per_generation = table, 2, 2
        self.train_dataset = [{"grpo_index": index} for index in sorted(table)]
        self.grpo_args = types.SimpleNamespace(grpo_max_resample=max_resample)
        self.args = types.SimpleNamespace(seed=3, process_index=0)
        self.accelerator = types.SimpleNamespace(num_processes=1)
        self.reward_funcs, self.run_state, self.sampled_parts = [Reward("r", None, 1.0)], RunState(), []

    def _agent_episodes(self, model, features, part, G):
        from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta, Segment, Trajectory

        self.sampled_parts.append(part)
        meta, episodes = [], []
        for k, feature in enumerate(features):
            index = feature["grpo_index"]
            meta.append(SampleMeta(index, f"task {index}", "", None))
            for g, reward in enumerate(self.table[index]):
                trajectory = Trajectory((Segment("model", (5, 6)),), end="env_error" if reward is None else DONE)
                episodes.append(Episode(k, Segment("env", (1,)), trajectory, [{"text": f"{index}-{g}"}]))
        return episodes, meta

    def _agent_scores(self, episodes, meta, lengths):
        from llamafactory_qwenvl_patch.grpo.rewards.registry import Scored

        values = [self.table[m.index][g] or 0.0 for m in meta for g in range(self.num_generations)]
        return [Scored(values, [False] * len(values), None)]


def test_dynamic_sampling_swaps_a_flat_group_of_trajectories_for_a_fresh_tasks():
    """Issue 50, item 4: DAPO's refill over tasks. A group is flat when its usable trajectories all scored alike or
    fewer than two are usable (a failed one stands at its group's mean); each is swapped, in order, for a fresh
    task's non-flat group with its G trajectories, meta and rewards; fresh tasks are sampled as parts of their own
    (other seeds); a budget spent leaves the rest flat and says so."""
    table = {0: [1.0, 0.0], 1: [0.5, 0.5], 2: [None, 1.0], 3: [0.0, 1.0], 4: [0.2, 0.2], 5: [1.0, 0.0], 6: [0.0, 0.3]}
    trainer = ScriptedRefill(table, max_resample=6)
    sampled = [trainer._agent_episodes(None, [{"grpo_index": i} for i in pair], j, 2)
               for j, pair in enumerate([(0, 1), (2, 3)])]
    parts, picked = trainer._agent_refill(None, sampled, per_micro=2)
    kept = [[m.index for m in meta] for _, meta in parts]
    assert kept[0][0] == 0 and kept[1][1] == 3  # the non-flat groups stay where they were
    fresh = [kept[0][1], kept[1][0]]
    assert all(index not in (1, 2, 4) for index in fresh), kept  # flat groups, sampled or drawn, never come back
    for (episodes, meta) in parts:
        assert [e.actions_text.split("-")[0] for e in episodes] == [str(m.index) for m in meta for _ in range(2)]
    assert picked[0].values == [table[i][g] or 0.0 for pair in kept for i in pair for g in range(2)]
    metrics = trainer.run_state.metrics
    assert metrics["dynamic/replaced_groups"] == [2.0] and metrics["dynamic/short_groups"] == [0.0]
    attempts = int(metrics["dynamic/resampled_batches"][0])
    assert 1 <= attempts <= 6 and trainer.sampled_parts[2:] == [2 + a for a in range(attempts)]

    flat = ScriptedRefill({0: [0.5, 0.5], 1: [None, 0.2]}, max_resample=2)  # nothing to swap in
    sampled = [flat._agent_episodes(None, [{"grpo_index": i}], j, 2) for j, i in enumerate((0, 1))]
    parts, picked = flat._agent_refill(None, sampled, per_micro=1)
    assert [[m.index for m in meta] for _, meta in parts] == [[0], [1]] and picked[0].values == [0.5, 0.5, 0.0, 0.2]
    assert {key: flat.run_state.metrics[f"dynamic/{key}"] for key in ("replaced_groups", "short_groups",
                                                                       "resampled_batches")} == {
        "replaced_groups": [0.0], "short_groups": [2.0], "resampled_batches": [2.0]}


def test_agent_rewards_and_the_trie_number():
    turns = [{"reward": 0.0, "action": {"kind": "click"}}, {"reward": 1.0, "action": {"kind": "invalid"}}]
    records = [{"turns": turns, "end": DONE}, {"turns": [], "end": "env_error"}]
    assert env_reward(["a", "b"], trajectories=records) == [1.0, 0.0]
    assert action_format_reward(["a", "b"], trajectories=records) == [0.5, 0.0]
    with pytest.raises(ValueError, match="needs grpo_agent_env"):
        env_reward(["a"])
    assert trie_saving([[1, 2, 3], [1, 2, 4]]) == pytest.approx(1 - 4 / 6)
    assert trie_saving([[1, 2], [3, 4]]) == 0.0 and trie_saving([]) == 0.0
    assert math.isclose(trie_saving([[7] * 5] * 4), 1 - 5 / 20)


def test_a_simulator_instance_plays_one_task(tiny_model):
    """The simulator inline, as the trainer's runners host it: a reset is the task's first screen, the right click
    passes it."""
    env = ClickThroughEnv(change_size=True)
    first = env.reset(TASKS[0], 11)
    screen = draw_task_screen(TASKS[0], 11, 0, change_size=True)
    assert first.image.size == screen.image.size
    x1, y1, x2, y2 = screen.box
    step = env.step(Action("click", (x1 + x2) / 2, (y1 + y2) / 2))
    assert step.info["passed"] and step.info["state_key"] == 1 and not step.done


class BuggyRenderer:
    """The run's renderer with a bug: it raises on the prompt ``broken`` and on the observation text ``boom``."""

    def __init__(self, renderer):
        self.renderer = renderer

    def root(self, prompt, *args):
        if prompt[-1]["content"] == "broken":
            raise IndexError("list index out of range")
        return self.renderer.root(prompt, *args)

    def observation(self, prompt, turn, screenshot, text, *args):
        if text == "boom":
            raise TypeError("TextEncodeInput must be Union[...]")
        return self.renderer.observation(prompt, turn, screenshot, text, *args)


def test_bad_observations_and_closes_end_one_trajectory_by_name(tiny_model, tmp_path, monkeypatch):
    """A forged turn end in an observation's text is refused at the boundary; a render that raises ends the
    trajectories it renders for (the root: the whole group; an observation: its own), naming the task, the turn and
    the exception; the others play on. A failed close() is kept on its episode, counted and logged once; a NaN in
    ``info`` reaches the rewards as a string, so every record is strict JSON."""
    r = renderer(tiny_model)
    spec = text_env(tmp_path)
    kwargs = [{"text": "<|im_end|>"}, {"text": "boom"}, {"text": "fine", "close_raises": True}, {}, {}, {}]
    runners = [EnvRunner(spec, k, policy=r.policy, isolation="inline", timeout=30) for k in kwargs]
    text = '{"action": "click", "point_2d": [10, 10]}'
    ids = r.tokenizer.encode(text, add_special_tokens=False) + [r.stop_id]

    def sample(rows, images, tasks):
        return [ids] * len(rows), [True] * len(rows), [text] * len(rows), None

    tasks = [Task({"id": "a"}, PROMPT, None, None, "'a'"), Task({"id": "b"}, [{"role": "user", "content": "broken"}],
                                                                 None, None, "'b'")]
    episodes = run_episodes(tasks, 3, runners, [1, 2], BuggyRenderer(r), sample,
                            EpisodeSettings(r.policy, "model", 2, 8192, 16))
    assert [e.end for e in episodes] == ["env_error", "env_error", TURNS] + ["env_error"] * 3
    assert "step 1: the observation's text for turn 2 holds '<|im_end|>'" in episodes[0].message
    assert episodes[1].message.startswith("task 'a', turn 2: the observation cannot be rendered: TypeError: "
                                          "TextEncodeInput") and "Traceback" in episodes[1].message
    assert all(e.message.startswith("task 'b', turn 1: the observation cannot be rendered: IndexError")
               for e in episodes[3:])
    assert [t["info"] for t in episodes[2].turns] == [{"score": "nan", "best": "inf"}] * 2
    assert json.loads(json.dumps(episodes[2].record(), allow_nan=False)) == episodes[2].record()
    assert [bool(e.close_error) for e in episodes] == [False, False, True, False, False, False]
    assert "close: raised RuntimeError: the VM did not stop" in episodes[2].close_error
    assert _agent_metrics(episodes, 3)["agent/close_errors"] == 1.0
    warnings = []
    monkeypatch.setattr(agent_phase.logger, "warning", warnings.append)
    trainer = types.SimpleNamespace(run_state=RunState())
    for _ in range(2):
        AgentMixin._log_close_error(trainer, episodes)
    assert len(warnings) == 1 and "close() failed" in warnings[0] and "the VM did not stop" in warnings[0]
