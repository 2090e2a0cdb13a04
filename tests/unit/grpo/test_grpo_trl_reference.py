"""The off-policy loss against trl 0.24's own ``GRPOTrainer._compute_loss`` with given old and reference
log-probs: ratios away from 1 (clipping acts), every loss type, token and sequence (GSPO) importance sampling."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llamafactory_qwenvl_patch.grpo.algorithm.losses import LossConfig, policy_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
EPS_LOW, EPS_HIGH, BETA, MAX_LEN = 0.2, 0.28, 0.04, 6


@pytest.fixture(scope="module")
def trl_trainer_class():
    from trl_compat import import_trl_grpo

    return import_trl_grpo()[1]


def trl_loss(trainer_class, logps, inputs, loss_type, importance):
    """trl's ``_compute_loss`` on a bare trainer whose model forward returns ``logps``."""
    from accelerate import Accelerator

    trainer = object.__new__(trainer_class)
    trainer.__dict__.update(
        top_entropy_quantile=1.0, beta=BETA, importance_sampling_level=importance, epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH, args=SimpleNamespace(delta=None), use_vllm=False,
        vllm_importance_sampling_correction=False, loss_type=loss_type, current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN, accelerator=Accelerator(cpu=True), model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
    )
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps))
    return trainer._compute_loss(None, inputs), trainer._metrics["train"]


def case(seed):
    g = torch.Generator().manual_seed(seed)
    n = 6
    lengths = torch.randint(1, MAX_LEN + 1, (n,), generator=g)
    mask = (torch.arange(MAX_LEN).unsqueeze(0) < lengths.unsqueeze(1)).long()
    old = -torch.rand(n, MAX_LEN, generator=g) * 3
    logps = old + torch.randn(n, MAX_LEN, generator=g) * 0.4  # ratios well outside [0.8, 1.28]
    ref = old + torch.randn(n, MAX_LEN, generator=g) * 0.2
    adv = torch.randn(n, generator=g)
    return logps, old, ref, adv, mask


@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_trl_compute_loss(trl_trainer_class, loss_type, importance, seed):
    logps, old, ref, adv, mask = case(seed)
    ours_in = logps.clone().requires_grad_(True)
    ours = policy_loss(ours_in, old, ref, adv, mask,
                       LossConfig(BETA, EPS_LOW, EPS_HIGH, loss_type, MAX_LEN, importance))
    ours.loss.backward()
    trl_in = logps.clone().requires_grad_(True)
    inputs = {"prompt_ids": torch.zeros(6, 2, dtype=torch.long), "prompt_mask": torch.ones(6, 2, dtype=torch.long),
              "completion_ids": torch.zeros(6, MAX_LEN, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    loss, metrics = trl_loss(trl_trainer_class, trl_in, inputs, loss_type, importance)
    loss.backward()
    assert ours.loss.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(ours_in.grad, trl_in.grad, atol=1e-6)
    assert ours.kl == pytest.approx(metrics["kl"][0], rel=1e-5)
    if importance == "token":
        assert ours.clip_ratio == pytest.approx(metrics["clip_ratio/region_mean"][0], rel=1e-5)
        assert ours.clip_ratio > 0
