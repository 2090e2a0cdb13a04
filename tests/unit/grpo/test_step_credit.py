"""GiGPO's step credit (``grpo_agent_credit: gigpo``): anchor groups of steps taken from one state, discounted returns
compared within them, worked by hand; per-token advantages in the policy loss."""

from __future__ import annotations

import pytest
import torch

from llamafactory_qwenvl_patch.grpo.algorithm.losses import LossConfig, policy_loss
from llamafactory_qwenvl_patch.grpo.algorithm.step_credit import (
    START,
    anchor_keys,
    discounted_returns,
    grouped_share,
    step_advantages,
)


def turns(*steps):
    """Turn records of (state_key after the step, reward); a state_key of None leaves the key out."""
    return [{"reward": r, "info": {} if key is None else {"state_key": key}} for key, r in steps]


# one task, G 3: the first misses screen 0 once then passes both; the second passes both at once; the third never
GROUP = [turns((0, 0.0), (1, 0.0), (2, 1.0)), turns((1, 0.0), (2, 1.0)), turns((0, 0.0), (0, 0.0), (0, 0.0))]


def test_anchor_keys_and_returns():
    assert anchor_keys(GROUP[0]) == [START, 0, 1] and anchor_keys(GROUP[2]) == [START, 0, 0]
    assert anchor_keys(turns(({"screen": [1, 2]}, 0.0), (3, 0.0))) == [START, (("screen", (1, 2)),)]
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]


def test_steps_from_one_state_are_compared_by_their_returns():
    """gamma 0.5. From the start: returns 0.25, 0.5, 0 (mean 0.25); from screen 0: 0.5 (the first's second step),
    0 and 0 (the third's) (mean 1/6); from screen 1: 1 and 1 (mean 1)."""
    got = step_advantages(GROUP, [True] * 3, 3, 0.5, scale=False)
    expected = [[0.0, 1 / 3, 0.0], [0.25, 0.0], [-0.25, -1 / 6, -1 / 6]]
    for row, want in zip(got, expected):
        assert row == pytest.approx(want)
    scaled = step_advantages(GROUP, [True] * 3, 3, 0.5, scale=True)  # the start group's std is 0.25
    assert scaled[1][0] == pytest.approx(0.25 / (0.25 + 1e-4))


def test_unusable_trajectories_and_missing_keys_leave_the_groups():
    """The second trajectory failed (no loss): it leaves every group, and the first's step from screen 1 is then
    alone (0). A step after one without a state_key is in no group."""
    got = step_advantages(GROUP, [True, False, True], 3, 0.5, scale=False)
    assert got[1] == [0.0, 0.0] and got[0][0] == pytest.approx(0.125) and got[0][2] == 0.0
    keyless = [turns((None, 0.0), (1, 1.0)), turns((None, 0.0), (1, 0.0))]
    assert step_advantages(keyless, [True, True], 2, 0.9, scale=False) == [[0.45, 0.0], [-0.45, 0.0]]
    assert grouped_share(keyless, [True, True], 2) == 0.5
    assert grouped_share(GROUP, [True] * 3, 3) == 1.0
    with pytest.raises(ValueError, match="not whole groups of 2"):
        step_advantages(GROUP, [True] * 3, 2, 0.5, scale=False)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_per_token_advantages_equal_per_sequence_ones_where_they_agree(loss_type):
    """(N, T) advantages equal to each row's (N,) value give the same loss and gradient; a token's own advantage
    moves only its own term."""
    torch.manual_seed(0)
    logps = torch.randn(3, 5, requires_grad=True)
    old, mask = logps.detach() + 0.1 * torch.randn(3, 5), torch.ones(3, 5)
    adv = torch.tensor([1.0, -0.5, 0.25])
    config = LossConfig(loss_type=loss_type, max_completion_length=5)
    one = policy_loss(logps, old, None, adv, mask, config).loss
    (grad_one,) = torch.autograd.grad(one, logps)
    per_token = adv.unsqueeze(1).expand(3, 5).clone()
    two = policy_loss(logps, old, None, per_token, mask, config).loss
    (grad_two,) = torch.autograd.grad(two, logps)
    assert two.item() == pytest.approx(one.item()) and torch.allclose(grad_one, grad_two)
    per_token[0, 2] = -3.0
    (grad_three,) = torch.autograd.grad(policy_loss(logps, old, None, per_token, mask, config).loss, logps)
    changed = (grad_three != grad_two).nonzero().tolist()
    assert changed == [[0, 2]]
