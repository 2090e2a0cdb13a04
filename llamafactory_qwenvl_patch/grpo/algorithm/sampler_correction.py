"""A sampler that is not the training model (vLLM): how far apart the two are, and the importance weights that
correct the loss for it (pure tensor functions).

Modes (trl's ``vllm_importance_sampling_mode``; verl's ``rollout_is`` / rejection sampling): the ratio
p_train / p_sampler per token, or one per sequence (the product over its tokens: unbiased, higher variance); then
``truncate`` (min(ratio, cap): TIS) or ``mask`` (0 where ratio > cap: the completion's tokens, or the whole
completion, leave the loss). Padding and tokens the sampler could not score (NaN) count as ratio 1, as in trl.
"""

from __future__ import annotations

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(train_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float) -> torch.Tensor:
    """(N, T) weights for ``token_*`` modes, (N, 1) for ``sequence_*``; no gradient (they change the measure, not
    the objective)."""
    if mode not in IS_MODES:
        raise ValueError(f"grpo_vllm_is_mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    diff = torch.nan_to_num((train_logps.detach() - sampler_logps) * mask.to(train_logps.dtype), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


def mismatch(train_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The sampler/trainer gap over the completion tokens: verl's ``kl`` (the direct estimator of
    KL(sampler || trainer), the mean of log p_sampler - log p_train) and ``k3_kl`` (the mean of r - log r - 1,
    r = p_train / p_sampler), and trl's mean and largest |log p_train - log p_sampler|. Tokens the sampler could
    not score (NaN) are left out, as trl does."""
    keep = mask.bool() & ~torch.isnan(sampler_logps)
    if not keep.any():
        return {}
    log_ratio = (train_logps.detach() - sampler_logps)[keep].double()
    return {"kl": float(-log_ratio.mean()), "k3_kl": float((torch.exp(log_ratio) - log_ratio - 1).mean()),
            "logp_diff/mean": float(log_ratio.abs().mean()), "logp_diff/max": float(log_ratio.abs().max())}
