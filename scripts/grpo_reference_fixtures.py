"""Write tests/fixtures/grpo_reference.json: the outputs of trl 1.x's and verl's own code on fixed tensors, which
tests/unit/grpo/test_grpo_variants_reference.py compares the plugin's GRPO variants against.

trl 1.x needs a newer trl than LLaMA-Factory 0.9.5 allows (<= 0.24), and verl pulls ray, so neither can sit in the
tested environment; this script runs in a side environment and its outputs are checked in. To regenerate:

    python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch==2.13.0 trl==1.16.0 transformers==5.6.0 \\
        accelerate datasets omegaconf ray orjson "tensordict>=0.8,<=0.10"
    /tmp/refenv/bin/pip install --no-deps verl==0.9.1
    /tmp/refenv/bin/python scripts/grpo_reference_fixtures.py

(verl 0.9.1 declares transformers != 5.6.0; the functions used here, ``core_algos`` and ``rollout_corr_helper``,
touch no transformers code.)

What is called, unchanged: trl's ``GRPOTrainer._compute_loss`` on a bare trainer whose model returns the given
log-probs and entropies (CISPO, ``delta``, the entropy bonus, the vLLM importance ratio in the loss), trl's
``entropy_from_logits``; verl's ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_outcome_advantage``, ``compute_reinforce_plus_plus_baseline_outcome_advantage``,
``compute_rollout_correction_weights`` (truncated token / sequence weights) and ``compute_offpolicy_metrics``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "grpo_reference.json"
N, T, G = 6, 7, 3  # completions, tokens, group size (two prompts)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    """Log-probs with ratios well outside the clip range, entropies, a ragged mask, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    old = -torch.rand(N, T, generator=g) * 3
    return dict(mask=mask, old=old, logps=old + torch.randn(N, T, generator=g) * 0.6,
                ref=old + torch.randn(N, T, generator=g) * 0.2, adv=torch.randn(N, generator=g),
                entropies=torch.rand(N, T, generator=g) * 4, sampler=old + torch.randn(N, T, generator=g) * 0.3,
                rewards=torch.rand(N, generator=g).round(decimals=1))


def trl_loss(case: dict[str, torch.Tensor], loss_type: str, importance: str, delta: float | None,
             entropy_coef: float, is_ratio: torch.Tensor | None, eps_low: float, eps_high: float, beta: float
             ) -> dict[str, object]:
    from accelerate import Accelerator
    from trl import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, beta=beta, importance_sampling_level=importance,
        epsilon_low=eps_low, epsilon_high=eps_high, loss_type=loss_type, current_gradient_accumulation_steps=1,
        max_completion_length=T, accelerator=Accelerator(cpu=True), model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)}, aux_loss_enabled=False, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, _entropy_bonus_enabled=entropy_coef != 0,
        entropy_coef=entropy_coef, use_adaptive_entropy=False,
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=1),
    )
    logps = case["logps"].clone().requires_grad_(True)
    entropies = case["entropies"].clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    inputs = {"prompt_ids": torch.zeros(N, 2, dtype=torch.long), "prompt_mask": torch.ones(N, 2, dtype=torch.long),
              "completion_ids": torch.zeros(N, T, dtype=torch.long), "completion_mask": case["mask"],
              "advantages": case["adv"], "old_per_token_logps": case["old"], "ref_per_token_logps": case["ref"],
              "num_items_in_batch": case["mask"].sum()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    metrics = trainer._metrics["train"]
    grad_entropies = None if entropies.grad is None else entropies.grad.tolist()
    return {"loss": loss.item(), "grad_logps": logps.grad.tolist(), "grad_entropies": grad_entropies,
            "entropy": metrics["entropy"][0], "kl": metrics["kl"][0] if metrics.get("kl") else None}


def main() -> None:
    from trl.trainer.utils import entropy_from_logits
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics, compute_rollout_correction_weights

    cases = {str(seed): tensors(seed) for seed in (0, 1, 2)}
    loss_settings = [  # (name, loss_type, importance, delta, entropy coef, vLLM IS ratio mode, eps low, eps high, beta)
        ("cispo_token", "cispo", "token", None, 0.0, None, 0.2, 5.0, 0.0),
        ("cispo_sequence", "cispo", "sequence", None, 0.0, None, 0.2, 5.0, 0.0),
        ("cispo_cap_binds", "cispo", "token", None, 0.0, None, 0.2, 1.5, 0.04),
        ("grpo_delta", "grpo", "token", 1.5, 0.0, None, 0.2, 0.28, 0.04),
        ("dapo_delta_entropy", "dapo", "token", 1.4, 0.01, None, 0.2, 0.28, 0.0),
        ("grpo_entropy", "grpo", "token", None, 0.05, None, 0.2, 0.2, 0.04),
        ("bnpo_sampler_token", "bnpo", "token", None, 0.0, "token", 0.2, 0.2, 0.04),
        ("bnpo_sampler_sequence", "bnpo", "token", None, 0.0, "sequence", 0.2, 0.2, 0.04),
    ]
    out: dict[str, object] = {"versions": {name: version(name) for name in ("trl", "verl", "torch")},
                              "cases": {}, "trl_loss": {}, "verl": {}}
    for seed, case in cases.items():
        out["cases"][seed] = {key: value.tolist() for key, value in case.items()}
        for name, loss_type, importance, delta, coef, is_level, eps_low, eps_high, beta in loss_settings:
            ratio = None
            if is_level is not None:  # verl's truncated weights, as trl multiplies them into the loss
                ratio, _ = compute_rollout_correction_weights(case["old"] - case["sampler"], case["mask"],
                                                              rollout_is=is_level, rollout_is_threshold=3.0)
                ratio = ratio[:, :1] if is_level == "sequence" else ratio
            out["trl_loss"][f"{name}/{seed}"] = trl_loss(case, loss_type, importance, delta, coef, ratio, eps_low,
                                                          eps_high, beta)
        g = torch.Generator().manual_seed(100 + int(seed))
        logits = torch.randn(N, T, 16, generator=g) * 3
        out["trl_loss"][f"entropy_from_logits/{seed}"] = {"logits": logits.tolist(),
                                                          "entropy": entropy_from_logits(logits / 0.7).tolist()}
        index = np.array([i // G for i in range(N)])
        lengths = case["mask"].sum(dim=1)
        token_rewards = torch.zeros(N, T)
        token_rewards[torch.arange(N), lengths - 1] = case["rewards"]  # the outcome reward on the last token
        rloo, _ = core_algos.compute_rloo_outcome_advantage(token_rewards.clone(), case["mask"], index)
        rpp, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(token_rewards.clone(), case["mask"],
                                                                          config=AlgoConfig(gamma=1.0))
        rppb, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
            token_rewards.clone(), case["mask"], index, config=AlgoConfig(gamma=1.0))
        weights = {}
        for level in ("token", "sequence"):
            w, _ = compute_rollout_correction_weights(case["old"] - case["sampler"], case["mask"], rollout_is=level,
                                                      rollout_is_threshold=3.0)
            weights[level] = w.tolist()
        mismatch = compute_offpolicy_metrics(case["old"], case["sampler"], case["mask"])
        out["verl"][seed] = {"rloo": rloo[:, 0].tolist(), "reinforce_plus_plus": rpp[:, 0].tolist(),
                             "reinforce_plus_plus_baseline": rppb[:, 0].tolist(), "truncate_weights": weights,
                             "kl": mismatch["kl"], "k3_kl": mismatch["k3_kl"]}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) with {out['versions']}")


if __name__ == "__main__":
    main()
