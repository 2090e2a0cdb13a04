"""GRPO loss math against a hand-computed example of 2 prompts x 3 completions, and rewards on garbage."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llamafactory_qwenvl_patch.grpo.algorithm.advantages import group_advantages as advantages
from llamafactory_qwenvl_patch.grpo.algorithm.losses import LossConfig, policy_loss
from llamafactory_qwenvl_patch.grpo.rewards.builtin import BUILTIN
from llamafactory_qwenvl_patch.grpo.rewards.registry import load_rewards

REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0]
EPS = 1e-4


def test_group_advantages_by_hand():
    # group 1: mean 0.5, sample std 0.5; group 2: mean 1/3, sample std sqrt(1/3)
    s2 = math.sqrt(1 / 3)
    expected = [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, (-1 / 3) / (s2 + EPS), (-1 / 3) / (s2 + EPS),
                (2 / 3) / (s2 + EPS)]
    assert advantages(torch.tensor(REWARDS), 3, "group").tolist() == pytest.approx(expected, rel=1e-6)
    assert advantages(torch.tensor(REWARDS), 3, "none").tolist() == pytest.approx(
        [0.5, -0.5, 0.0, -1 / 3, -1 / 3, 2 / 3], rel=1e-6)
    batch_std = torch.tensor(REWARDS).std().item()
    assert advantages(torch.tensor(REWARDS), 3, "batch").tolist() == pytest.approx(
        [v / (batch_std + EPS) for v in [0.5, -0.5, 0.0, -1 / 3, -1 / 3, 2 / 3]], rel=1e-6)


# Per sequence two tokens. Sequence 0 token 0 has ratio 1.5 (A > 0: clipped to 1.2); sequence 1 token 0 has ratio
# 0.5 (A < 0: clipped to 0.8); every other token has ratio 1. Sequence 2's second token is padding.
ADV = [1.0, -1.0, 0.5, -0.25, -0.25, 0.5]
LOGPS = [[math.log(1.5) - 1, -1.0], [math.log(0.5) - 1, -1.0]] + [[-1.0, -1.0]] * 4
OLD = [[-1.0, -1.0]] * 6
REF = [[-1.2, -1.0]] * 6
MASK = [[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]]
BETA, CLIP = 0.1, 0.2


def hand_per_token():
    rows = []
    for i in range(6):
        row = []
        for t in range(2):
            ratio = math.exp(LOGPS[i][t] - OLD[i][t])
            a = ADV[i]
            surrogate = -min(ratio * a, min(max(ratio, 1 - CLIP), 1 + CLIP) * a)
            delta = REF[i][t] - LOGPS[i][t]
            row.append(surrogate + BETA * (math.exp(delta) - delta - 1))
        rows.append(row)
    return rows


def run(loss_type, total_tokens=None):
    t = torch.tensor
    return policy_loss(t(LOGPS), t(OLD), t(REF), t(ADV), t(MASK), LossConfig(BETA, CLIP, CLIP, loss_type, 2), total_tokens)


def test_clipping_and_kl_by_hand():
    per_token = hand_per_token()
    assert per_token[0][0] == pytest.approx(-1.2 + BETA * (math.exp(-0.2 - math.log(1.5)) + 0.2 + math.log(1.5) - 1))
    assert per_token[1][0] == pytest.approx(0.8 + BETA * (math.exp(-0.2 - math.log(0.5)) + 0.2 + math.log(0.5) - 1))
    parts = run("grpo")
    assert parts.clip_ratio == pytest.approx(2 / 11)
    kl_tokens = [math.exp(REF[i][t] - LOGPS[i][t]) - (REF[i][t] - LOGPS[i][t]) - 1
                 for i in range(6) for t in range(2) if MASK[i][t]]
    assert parts.kl == pytest.approx(sum(kl_tokens) / 11)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_each_loss_type_by_hand(loss_type):
    per_token = hand_per_token()
    masked = [[v * m for v, m in zip(row, mrow)] for row, mrow in zip(per_token, MASK)]
    if loss_type == "grpo":
        expected = sum(sum(r) / sum(m) for r, m in zip(masked, MASK)) / 6
    elif loss_type in ("bnpo", "dapo"):
        expected = sum(map(sum, masked)) / 11
    else:
        expected = sum(map(sum, masked)) / (6 * 2)
    assert run(loss_type).loss.item() == pytest.approx(expected, rel=1e-5)
    if loss_type == "dapo":
        assert run("dapo", total_tokens=22).loss.item() == pytest.approx(sum(map(sum, masked)) / 22, rel=1e-5)


def test_gradient_flows_through_ratio():
    logps = torch.tensor(LOGPS, requires_grad=True)
    parts = policy_loss(logps, torch.tensor(OLD), None, torch.tensor(ADV), torch.tensor(MASK),
                        LossConfig(0.0, CLIP, CLIP, "bnpo", 2))
    parts.loss.backward()
    assert logps.grad[2, 0].item() == pytest.approx(-0.5 / 11)  # d(-ratio*A)/dlogp = -A at ratio 1
    assert logps.grad[2, 1].item() == 0.0  # padding
    assert logps.grad[0, 0].item() == 0.0  # clipped


BOX = json.dumps([{"bbox_2d": [10, 20, 110, 220], "label": "cat"}, {"bbox_2d": [300, 300, 400, 380], "label": "dog"}])


def test_iou_reward_exact_disjoint_and_order():
    iou = BUILTIN["iou"]
    swapped = json.dumps(list(reversed(json.loads(BOX))))
    fenced = f"```json\n{BOX}\n```"
    disjoint = json.dumps([{"bbox_2d": [500, 500, 600, 600]}])
    one = json.dumps([{"bbox_2d": [10, 20, 110, 220]}])
    assert iou([BOX, swapped, fenced, disjoint, one], references=[BOX] * 5) == [1.0, 1.0, 1.0, 0.0, 0.5]
    floats = json.dumps([{"bbox_2d": [10.0, 20.0, 110.0, 220.0]}, {"bbox_2d": [300.0, 300, 400, 380]}])
    assert iou([floats], references=[BOX]) == [1.0]
    assert iou(["<|box_start|>(10,20),(110,220)<|box_end|>"], references=[one]) == [1.0]


def test_format_json_fields_accuracy():
    assert BUILTIN["format"]([BOX, "no boxes", '[{"point_2d": [1, 2]}]'], references=[BOX] * 3) == [1.0, 0.0, 0.0]
    truth = '{"invoice_number": "INV-7", "date": "2024-03-05", "amount": "1,234.50"}'
    answer = '```json\n{"invoice_number": "inv-7", "date": "2024-03-06", "amount": "1,234.50"}\n```'
    assert BUILTIN["json_fields"]([answer], references=[truth]) == [pytest.approx(2 / 3)]
    assert BUILTIN["accuracy"](["  Paris. ", "Lyon"], references=["paris", "Paris"]) == [1.0, 0.0]


def test_iou_and_format_on_a_not_present_reference():
    """A "not present" sample (reference ``[]``, from convert --coco-absent) rewards saying nothing, in any
    spelling of the empty list, and scores a hallucinated box 0."""
    empties = ["[]", " [ ] ", "```json\n[]\n```"]
    completions = [*empties, '[{"bbox_2d": [1, 2, 30, 40]}]', "There is none.", "{}", ""]
    assert BUILTIN["iou"](completions, references=["[]"] * 7) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert BUILTIN["format"](completions, references=["[]"] * 7) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert BUILTIN["iou"](["[]"], references=[BOX]) == [0.0]


def test_grpo_evaluation_scores_not_present_samples_apart():
    from llamafactory_qwenvl_patch.grpo.rewards.evaluation import eval_metrics
    from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta

    meta = [SampleMeta(i, "p", reference, (480, 640), (476, 644)) for i, reference in enumerate(["[]", "[]", BOX])]
    texts = ["[]", '[{"bbox_2d": [1, 2, 30, 40]}]', BOX]
    metrics = eval_metrics(meta, texts, load_rewards("iou", None), None, "model", "eval")
    assert metrics["eval_not_present/said_nothing_rate"] == 0.5
    assert metrics["eval_not_present/false_positive_rate"] == 0.5
    assert metrics["eval_acc@0.5"] == 1.0 and metrics["eval_rewards/iou/mean"] == pytest.approx(2 / 3, abs=1e-6)


RANGES = {"no_cheat": (-1.0, 0.0), "fields_raw": (0.0, math.inf)}


HUGE = "9" * 5000  # Python refuses to make an int of it (over 4,300 digits)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=80) | st.sampled_from(["[", "```json\n[{\"bbox_2d\": [1, 2]}]```", '[{"bbox_2d": "x"}]',
                                                         '{"a": NaN}', "<|box_start|>(1,2),(3,<|box_end|>",
                                                         f'[{{"bbox_2d": [1, 2, {HUGE}, 4]}}]',
                                                         f'[{{"point_2d": [1, 1{"0" * 400}]}}]',
                                                         f'{{"invoice_number": {HUGE}}}']),
                min_size=1, max_size=5),
       st.sampled_from([BOX, '{"a": 1}', "plain", "", f'[{{"bbox_2d": [1, 2, {HUGE}, 4]}}]']))
def test_rewards_never_raise_on_garbage(completions, reference):
    from llamafactory_qwenvl_patch.grpo.rewards.agent import AGENT_REWARDS

    for name, func in BUILTIN.items():  # an agent reward reads the trajectories, which the trainer builds
        extra = {"trajectories": [{"turns": [{"text": c, "action": {"kind": "invalid", "reason": "garbage"},
                                              "reward": 0.0}], "end": "turns"} for c in completions]} \
            if name in AGENT_REWARDS else {}
        values = func(completions, references=[reference] * len(completions), orig_sizes=[None] * len(completions),
                      model_sizes=[None] * len(completions), policy=None, indices=list(range(len(completions))),
                      coords="model", **extra)
        low, high = RANGES.get(name, (0.0, 1.0))
        assert len(values) == len(completions) and all(low <= v <= high for v in values), name


def test_reward_loading(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def length(completions, **kw):\n    return [len(c) / 100 for c in completions]\n")
    loaded = load_rewards(f"iou,{path}:length", "2,0.5")
    assert [(r.name, r.weight) for r in loaded] == [("iou", 2.0), ("length", 0.5)]
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2"):
        load_rewards("iou,format", "1")
    with pytest.raises(ValueError, match="no function nope"):
        load_rewards(f"{path}:nope", None)


def test_batch_scaling_takes_the_global_std():
    local = advantages(torch.tensor(REWARDS), 3, "batch", batch_std=0.25)
    assert local.tolist() == pytest.approx([v / (0.25 + EPS) for v in [0.5, -0.5, 0.0, -1 / 3, -1 / 3, 2 / 3]])


def test_rewards_that_overflow_exit_or_empty_their_inputs_fail_by_name(tmp_path):
    """Issue 33, class 7: 1e39 passed the finite check and overflowed the float32 rewards to inf; sys.exit(0) in a
    reward ended training with rc 0; a reward that emptied its completions list broke the length check; a reward
    file with a syntax error or a raise at import gave a raw traceback."""
    from llamafactory_qwenvl_patch.grpo.rewards.registry import Reward, score

    columns = {"references": ["r", "r"]}
    shared = {"resize_policy": None, "coords": "model"}

    def huge(completions, **kw):
        return [1e39 for _ in completions]

    def leaves(completions, **kw):
        raise SystemExit(0)

    def empties(completions, references, **kw):
        completions.clear()
        references.clear()
        return [1.0, 1.0]

    scored = score(Reward("huge", huge, 1.0), ["a", "b"], columns, shared)
    assert scored.errors == [True, True] and scored.values == [0.0, 0.0] and "float32" in scored.failure
    scored = score(Reward("leaves", leaves, 1.0), ["a", "b"], columns, shared)
    assert scored.errors == [True, True] and "sys.exit(0)" in scored.failure
    scored = score(Reward("empties", empties, 1.0), ["a", "b"], columns, shared)
    assert scored.errors == [False, False] and scored.values == [1.0, 1.0] and columns["references"] == ["r", "r"]
    (tmp_path / "broken.py").write_text("def f(completions, **kw):\n    return [1.0 for c in completions\n")
    (tmp_path / "raising.py").write_text("import os\nraise RuntimeError('no GPU for my reward model')\n")
    (tmp_path / "exiting.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError, match=r"broken.py:f.*cannot be loaded: SyntaxError.*line 2"):
        load_rewards(f"{tmp_path / 'broken.py'}:f", None)
    with pytest.raises(ValueError, match=r"raising.py:f.*RuntimeError: no GPU for my reward model.*line 2"):
        load_rewards(f"{tmp_path / 'raising.py'}:f", None)
    with pytest.raises(ValueError, match=r"exiting.py:f.*SystemExit: 3"):
        load_rewards(f"{tmp_path / 'exiting.py'}:f", None)
    with pytest.raises(ValueError, match=r"nope_module_xyz:f.*ModuleNotFoundError"):
        load_rewards("nope_module_xyz:f", None)


def test_a_trajectory_trains_its_model_segments_only():
    """The rollout's layout for several turns: a trajectory's ids are its segments in order, its loss mask 1 on model
    tokens and 0 on what the environment rendered; a single-turn completion is one model segment."""
    from llamafactory_qwenvl_patch.grpo.rollout.types import Segment, Trajectory

    screen = object()
    turns = Trajectory((Segment("model", (5, 6, 2)), Segment("env", (9, 8, 8, 7), (screen,)), Segment("model", (4, 2))))
    assert turns.rows() == ([5, 6, 2, 9, 8, 8, 7, 4, 2], [1, 1, 1, 0, 0, 0, 0, 1, 1])
    assert turns.images == [screen]
    assert Trajectory((Segment("model", (3, 2)),)).rows() == ([3, 2], [1, 1])
    with pytest.raises(ValueError, match="'model' or 'env'"):
        Segment("tool", (1,))


def test_each_estimator_reduces_over_ranks_as_it_declares():
    """An estimator's record says how its batch statistics cross ranks; each built-in asks the other ranks exactly
    that (a recording ``Ranks`` with several ranks: gathering or summing nothing changes on one process)."""
    from llamafactory_qwenvl_patch.grpo.algorithm.advantages import ESTIMATOR_REGISTRY

    class Recording:
        several = True

        def __init__(self):
            self.calls = set()

        def gather(self, values):
            self.calls.add("gather")
            return values

        def sum(self, values):
            self.calls.add("sum")
            return values

    rewards, lengths = torch.tensor([0.0, 1.0, 0.5, 0.5]), torch.tensor([3, 1, 2, 4])
    for name in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        estimator = ESTIMATOR_REGISTRY[name]
        ranks = Recording()
        estimator.advantages(rewards, lengths, 2, "batch" if estimator.takes_scale else "group", ranks)
        assert ranks.calls == (set() if estimator.reduces == "none" else {estimator.reduces}), name
