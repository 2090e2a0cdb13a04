"""The GRPO variants of issue 42 against their reference implementations, on fixed tensors: trl 1.16's own
``_compute_loss`` (CISPO, two-sided clipping, the entropy bonus, a sampler's importance weights in the loss) and
``entropy_from_logits``, verl 0.9.1's advantage estimators (RLOO, REINFORCE++, REINFORCE++-baseline), truncated
importance weights and mismatch metrics. Their outputs come from ``scripts/grpo_reference_fixtures.py``, run in a
side environment (trl 1.x cannot sit beside LLaMA-Factory 0.9.5) and checked in as tests/fixtures/grpo_reference.json.
The rules the references do not cover as functions (trl's mask modes, DAPO's overlong reward, the click monitors) are
checked by hand below."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llamafactory_qwenvl_patch.grpo.algorithm.advantages import (
    batch_moments,
    estimator,
    rloo_advantages,
    whitened,
)
from llamafactory_qwenvl_patch.grpo.algorithm.losses import LossConfig, policy_loss
from llamafactory_qwenvl_patch.grpo.algorithm.sampler_correction import importance_weights, mismatch
from llamafactory_qwenvl_patch.grpo.algorithm.token_stats import row_logps_and_entropy
from llamafactory_qwenvl_patch.grpo.rewards.length import overlong_reward
from llamafactory_qwenvl_patch.scoring.clicks import ClickMonitorTally

FIXTURE = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "grpo_reference.json").read_text())
SEEDS = sorted(FIXTURE["cases"])
G = 3
# name -> (loss_type, importance, delta, entropy coef, sampler IS level, eps low, eps high, beta), as the script ran
SETTINGS = {
    "cispo_token": ("cispo", "token", None, 0.0, None, 0.2, 5.0, 0.0),
    "cispo_sequence": ("cispo", "sequence", None, 0.0, None, 0.2, 5.0, 0.0),
    "cispo_cap_binds": ("cispo", "token", None, 0.0, None, 0.2, 1.5, 0.04),
    "grpo_delta": ("grpo", "token", 1.5, 0.0, None, 0.2, 0.28, 0.04),
    "dapo_delta_entropy": ("dapo", "token", 1.4, 0.01, None, 0.2, 0.28, 0.0),
    "grpo_entropy": ("grpo", "token", None, 0.05, None, 0.2, 0.2, 0.04),
    "bnpo_sampler_token": ("bnpo", "token", None, 0.0, "token", 0.2, 0.2, 0.04),
    "bnpo_sampler_sequence": ("bnpo", "token", None, 0.0, "sequence", 0.2, 0.2, 0.04),
}


def case(seed: str) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(value) for key, value in FIXTURE["cases"][seed].items()}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_loss_matches_trl_compute_loss(name, seed):
    loss_type, importance, delta, coef, level, eps_low, eps_high, beta = SETTINGS[name]
    data, expected = case(seed), FIXTURE["trl_loss"][f"{name}/{seed}"]
    config = LossConfig(beta, eps_low, eps_high, loss_type, data["mask"].size(1), importance,
                        cispo_cap=eps_high, delta=delta, entropy_coef=coef)
    logps = data["logps"].clone().requires_grad_(True)
    entropies = data["entropies"].clone().requires_grad_(True)
    weights = None if level is None else importance_weights(data["old"], data["sampler"], data["mask"],
                                                            f"{level}_truncate", 3.0)
    parts = policy_loss(logps, data["old"], data["ref"], data["adv"], data["mask"], config,
                        sampling_weights=weights, entropies=entropies)
    parts.loss.backward()
    assert parts.loss.item() == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)
    assert torch.allclose(logps.grad, torch.tensor(expected["grad_logps"]), atol=1e-6)
    if expected["grad_entropies"] is not None:
        assert torch.allclose(entropies.grad, torch.tensor(expected["grad_entropies"]), atol=1e-7)
    else:
        assert entropies.grad is None or not entropies.grad.any()
    assert parts.entropy == pytest.approx(expected["entropy"], rel=1e-5)
    if expected["kl"] is not None:
        assert parts.kl == pytest.approx(expected["kl"], rel=1e-5)


def test_the_cases_make_every_variant_act():
    """The fixed tensors reach the regions each variant changes: CISPO's cap binds, delta binds on negative
    advantages, so the references' losses differ from plain GRPO's."""
    data = case(SEEDS[0])
    ratio = torch.exp(data["logps"] - data["old"])[data["mask"].bool()]
    assert (ratio > 1.5).any() and (ratio < 0.8).any()
    plain = policy_loss(data["logps"], data["old"], data["ref"], data["adv"], data["mask"],
                        LossConfig(0.04, 0.2, 0.28, "grpo", 7)).loss.item()
    assert FIXTURE["trl_loss"][f"grpo_delta/{SEEDS[0]}"]["loss"] != pytest.approx(plain, rel=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_matches_trl_entropy_from_logits(seed):
    expected = FIXTURE["trl_loss"][f"entropy_from_logits/{seed}"]
    logits = torch.tensor(expected["logits"])
    banned = torch.tensor([], dtype=torch.long)
    ids = torch.zeros(logits.size(1), dtype=torch.long)
    ours = torch.stack([row_logps_and_entropy(row, ids, banned, 0.7, entropy=True)[1] for row in logits])
    assert torch.allclose(ours, torch.tensor(expected["entropy"]), atol=1e-5)


def test_suppressed_tokens_leave_the_entropy_finite_and_out_of_the_distribution():
    logits = torch.randn(5, 12)
    ids = torch.arange(5)
    banned = torch.tensor([10, 11])
    logps, entropy = row_logps_and_entropy(logits.clone().requires_grad_(True), ids, banned, 1.0, True, True)
    reference = torch.distributions.Categorical(logits=logits[:, :10]).entropy()
    assert torch.allclose(entropy, reference, atol=1e-6)
    entropy.sum().backward()  # no NaN from 0 x -inf
    assert torch.isfinite(logps).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_advantages_match_verl(seed):
    data, expected = case(seed), FIXTURE["verl"][seed]
    rewards, lengths = data["rewards"], data["mask"].sum(dim=1)
    assert torch.allclose(rloo_advantages(rewards, G), torch.tensor(expected["rloo"]), atol=1e-6)
    one_rank = SimpleNamespace(several=False)
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        ours = estimator(name).advantages(rewards, lengths, G, "group", one_rank)
        assert torch.allclose(ours, torch.tensor(expected[name]), atol=1e-5), name


def test_whitening_moments_add_over_ranks():
    """Two ranks' moments summed whiten exactly as the whole batch's: what the trainer's reduce relies on."""
    values, lengths = torch.tensor([0.0, 1.0, 0.5, 0.2, 0.9, 0.4]), torch.tensor([3, 1, 7, 2, 2, 5])
    whole = whitened(values, batch_moments(values, lengths))
    split = batch_moments(values[:3], lengths[:3]) + batch_moments(values[3:], lengths[3:])
    assert torch.allclose(whitened(values, split), whole, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
def test_truncated_weights_and_mismatch_match_verl(seed):
    data, expected = case(seed), FIXTURE["verl"][seed]
    mask = data["mask"].bool()
    for level in ("token", "sequence"):
        ours = importance_weights(data["old"], data["sampler"], data["mask"], f"{level}_truncate", 3.0)
        reference = torch.tensor(expected["truncate_weights"][level])
        assert torch.allclose(ours.expand_as(reference)[mask], reference[mask], atol=1e-6), level
    found = mismatch(data["old"], data["sampler"], data["mask"])
    assert found["kl"] == pytest.approx(expected["kl"], rel=1e-5)
    assert found["k3_kl"] == pytest.approx(expected["k3_kl"], rel=1e-5)
    diff = (data["old"] - data["sampler"]).abs()[mask]
    assert found["logp_diff/max"] == pytest.approx(float(diff.max()))


def test_mask_modes_zero_what_passes_the_cap_as_trl_documents():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.5, 0.1, 0.0], [-0.4, -0.4, -0.4]])  # token ratios e^1.5 = 4.5, e^-0.1; e^0.4 x 3
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    token = importance_weights(old, sampler, mask, "token_mask", 3.0)
    assert token[0, 0] == 0 and token[0, 1] == pytest.approx(math.exp(-0.1)) and token[0, 2] == 1.0
    sequence = importance_weights(old, sampler, mask, "sequence_mask", 3.0)
    assert sequence.shape == (2, 1)
    assert sequence[0, 0] == 0  # e^1.4 > 3: the whole completion leaves the loss
    assert sequence[1, 0] == 0  # e^1.2 = 3.32 > 3, though no single token passes the cap
    assert importance_weights(old, sampler, mask, "sequence_truncate", 3.0)[1, 0] == 3.0
    nan = importance_weights(old, torch.full((2, 3), math.nan), mask, "token_mask", 3.0)
    assert (nan == 1).all()  # a token the sampler could not score: no correction, as trl
    with pytest.raises(ValueError, match="grpo_vllm_is_mode"):
        importance_weights(old, sampler, mask, "sequence", 3.0)


def test_overlong_reward_is_dapos_soft_punishment():
    lengths = [10, 80, 81, 90, 100, None]
    values = overlong_reward(["x"] * 6, completion_lengths=lengths, max_completion_length=100, overlong_buffer=20)
    assert values == [0.0, 0.0, pytest.approx(-0.05), pytest.approx(-0.5), -1.0, 0.0]
    default = overlong_reward(["x"], completion_lengths=[90], max_completion_length=100)
    assert default == [pytest.approx(-0.5)]  # a fifth of the limit: (80 - 90) / 20
    assert overlong_reward(["x"]) == [0.0]


def test_click_monitors_count_the_hacks_of_a_group():
    tally = ClickMonitorTally()
    centre = '[{"point_2d": [500, 500]}]'
    tally.add_group([centre, centre, centre], (1000.0, 1000.0))  # one collapsed group: the centre every time
    tally.add_group(['[{"point_2d": [10, 20]}, {"point_2d": [30, 40]}]', '[{"point_2d": [1200, 5]}]', "no"],
                    (1000.0, 1000.0))
    other = ClickMonitorTally()
    other.add_group(['[{"point_2d": [300, 300]}]', '[{"point_2d": [301, 300]}]'], (1000.0, 1000.0))
    tally.merge(other)
    found = tally.to_dict()
    assert found["click_multi_point_rate"] == pytest.approx(1 / 8)
    assert found["click_outside_rate"] == pytest.approx(1 / 7)
    assert found["click_centre_rate"] == pytest.approx(3 / 7)
    assert found["click_same_point_group_rate"] == pytest.approx(1 / 3)


def test_a_swapped_prompt_takes_its_blank_copy_with_it():
    """Dynamic sampling with the blank-image control: swapping prompt 0 for a fresh prompt drops prompt 0's blank
    copy (the blank check compares a copy with its original, which is gone), and keeps prompt 1's."""
    from types import SimpleNamespace

    from llamafactory_qwenvl_patch.grpo.rollout.types import SampledPart, SampleMeta
    from llamafactory_qwenvl_patch.grpo.trainer.refill import RefillMixin, ScoredPart
    from llamafactory_qwenvl_patch.grpo.trainer.rollout_phase import RolloutMixin

    group = 2

    class Assembler(RefillMixin, RolloutMixin):
        num_generations = group
        vision_start_id, image_id = 1, 2
        tokenizer = SimpleNamespace(pad_token_id=0)

        def _collate(self, features):
            batch = {"input_ids": torch.tensor([[5, 1, 2, 2, 5]] * len(features)),
                     "image_grid_thw": torch.tensor([[1, 2, 4]] * len(features))}
            return batch, [SampleMeta(f["grpo_index"], "p", "", (4, 4), blank=f.get("grpo_blank", False))
                           for f in features]

    def part(features):
        rows = len(features) * group
        return SampledPart(features=features, batch=None, texts=[f"t{i}" for i in range(rows)],
                           meta=[SampleMeta(f["grpo_index"], "p", "", (4, 4), blank=f.get("grpo_blank", False))
                                 for f in features],
                           ids=torch.arange(rows * 3).view(rows, 3), attention=torch.ones(rows, 3, dtype=torch.long),
                           stopped=torch.ones(rows, dtype=torch.bool), sampling_logps=None)

    mine = part([{"grpo_index": 0}, {"grpo_index": 1}, {"grpo_index": 0, "grpo_blank": True},
                 {"grpo_index": 1, "grpo_blank": True}])
    donor = part([{"grpo_index": 7}])
    sources = [ScoredPart(mine, [0, 1], [], [True, False]), ScoredPart(donor, [0], [], [False])]
    swapped = Assembler()._swapped(sources, 0, {(0, 0): (1, 0)})
    assert [(m.index, m.blank) for m in swapped.meta] == [(7, False), (1, False), (1, True)]
    assert torch.equal(swapped.ids[:group], donor.ids)  # the donor's completions, then prompt 1's and its copy's
    assert torch.equal(swapped.ids[group:], mine.ids[[2, 3, 6, 7]])
