"""The optimisation half of ``GRPOTrainer``: each micro-step takes its stored ``MicroBatch`` (rolling out first
when a round begins) and optimises the clipped surrogate on the token log-probs of the sampled distribution."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch

from llamafactory_qwenvl_patch.grpo import shared_prefix
from llamafactory_qwenvl_patch.grpo.loss import policy_loss
from llamafactory_qwenvl_patch.grpo.reference import reference_context
from llamafactory_qwenvl_patch.grpo.rollout import MicroBatch


class StepMixin:
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Roll out on the first micro-step of each round (or after a resume), then optimise the stored slice."""
        round_length = self.steps_per_generation * self.num_iterations
        if self._buffer is None:  # epochs hold whole rounds, so this is the position in the round after a resume
            self._micro_step = 0 if self.args.ignore_data_skip else self.state.global_step * self.grad_accum
        position = self._micro_step % round_length
        if self._buffer is None or position == 0:
            self._buffer = self._rollout(model, inputs["grpo_features"])
        micro = self._buffer[position % self.steps_per_generation]
        self._first_pass = position < self.steps_per_generation
        self._micro_step += 1
        with self._shared_attention():  # the backward too: gradient checkpointing recomputes the forward there
            return super().training_step(model, {"grpo": micro}, num_items_in_batch)

    def _attention_models(self) -> list[Any]:
        """The models whose passes share the prefix: the policy and, when there is one, the separate reference."""
        return [self.model] + ([self.ref_model] if self.ref_model is not None else [])

    def _shared_attention(self) -> ContextManager[None]:
        if not self.shared_prefix:
            return nullcontext()
        return shared_prefix.attention_active(self._attention_models())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        micro: MicroBatch = inputs["grpo"]
        logps = self._token_logps(model, micro.inputs, micro.completion_ids)
        old = micro.old_logps if micro.old_logps is not None else logps.detach()
        weights = self._sampling_weights(old, micro) if micro.sampling_logps is not None else None
        parts = policy_loss(logps, old, micro.ref_logps, micro.advantages, micro.mask, self.fa.grpo_beta,
                            self.fa.grpo_epsilon, self.fa.grpo_epsilon_high, self.fa.grpo_loss_type,
                            self.max_new_tokens, micro.token_normalizer, micro.seq_normalizer,
                            self.fa.grpo_importance_sampling, weights)
        self._metrics["kl"].append(parts.kl)
        self._metrics["clip_ratio"].append(parts.clip_ratio)
        return parts.loss

    def _sampling_weights(self, old: torch.Tensor, micro: MicroBatch) -> torch.Tensor | None:
        """Log how far vLLM's sampling log-probs are from the training model's (first pass over a rollout) and, with
        ``grpo_vllm_is_correction``, the truncated importance weights min(p_train / p_vllm, cap) per token."""
        mask = micro.mask.bool()
        if self._first_pass and mask.any():
            diff = (old - micro.sampling_logps).abs()[mask]
            self._metrics["vllm/logp_diff/mean"].append(float(diff.mean()))
            self._metrics["vllm/logp_diff/max"].append(float(diff.max()))
        if not self.fa.grpo_vllm_is_correction:
            return None
        weights = torch.exp(old - micro.sampling_logps).clamp(max=self.fa.grpo_vllm_is_cap)
        if self._first_pass and mask.any():
            self._metrics["vllm/is_weight/mean"].append(float(weights[mask].mean()))
        return weights

    def _token_logps(self, model: Any, inputs: dict[str, Any], completion_ids: torch.Tensor) -> torch.Tensor:
        """Log-probs of the completion tokens under softmax(logits / T) with the vision tokens suppressed, i.e. the
        distribution that was sampled. A shared-prefix forward must run inside ``_shared_attention``."""
        layout = inputs.get(shared_prefix.KWARG)
        keep = completion_ids.size(1) + 1 if layout is None else layout.keep
        logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
        if logits.size(1) == inputs["input_ids"].size(1):  # the model ignores logits_to_keep (4.57's Qwen2-VL)
            logits = logits[:, -keep:] if layout is None else logits[:, keep]
        logits = logits[:, :-1, :] if layout is None else shared_prefix.unpack_logits(logits, layout)
        banned = torch.tensor(self.suppressed, device=logits.device, dtype=torch.long)
        # Row by row in float32: a full-vocabulary log_softmax of every completion at once costs G x T x V floats.
        rows = []
        for row_logits, row_ids in zip(logits, completion_ids):
            row_logits = row_logits.float() / self.temperature
            if len(banned):
                row_logits = row_logits.index_fill(1, banned, float("-inf"))
            chosen = torch.gather(row_logits, 1, row_ids.unsqueeze(-1)).squeeze(-1)
            rows.append(chosen - torch.logsumexp(row_logits, dim=-1))
        return torch.stack(rows)

    def _reference_logps(self, model: Any, inputs: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        if self.ref_model is not None:
            return self._token_logps(self.ref_model, inputs, ids)
        with reference_context(self.accelerator.unwrap_model(model)):
            return self._token_logps(model, inputs, ids)
