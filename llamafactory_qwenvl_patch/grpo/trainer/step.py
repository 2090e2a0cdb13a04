"""The optimisation half of ``GRPOTrainer``: each micro-step takes its stored ``MicroBatch`` (rolling out first
when a round begins) and optimises the clipped surrogate on the token log-probs of the sampled distribution."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch

from llamafactory_qwenvl_patch.grpo.algorithm.losses import policy_loss
from llamafactory_qwenvl_patch.grpo.algorithm.reference import reference_context
from llamafactory_qwenvl_patch.grpo.algorithm.sampler_correction import importance_weights, mismatch
from llamafactory_qwenvl_patch.grpo.algorithm.token_stats import row_logps_and_entropy
from llamafactory_qwenvl_patch.grpo.rollout import shared_prefix
from llamafactory_qwenvl_patch.grpo.rollout.agent_rows import ACTION_INDEX
from llamafactory_qwenvl_patch.grpo.rollout.types import MicroBatch


class StepMixin:
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Roll out on the first micro-step of each round (or after a resume), then optimise the stored slice."""
        round_length = self.steps_per_generation * self.num_iterations
        if self.run_state.buffer is None:  # epochs hold whole rounds: this is the position in the round after a resume
            self.run_state.micro_step = 0 if self.args.ignore_data_skip else self.state.global_step * self.grad_accum
        position = self.run_state.micro_step % round_length
        if self.run_state.buffer is None or position == 0:
            self.run_state.buffer = self._rollout(model, inputs["grpo_features"])
        micro = self.run_state.buffer[position % self.steps_per_generation]
        self.run_state.first_pass = position < self.steps_per_generation
        self.run_state.micro_step += 1
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
        logps, entropies = self._token_logps(model, micro.inputs, micro.completion_ids, entropy=True,
                                             entropy_grad=self.grpo_args.grpo_entropy_coef != 0)
        old = micro.old_logps if micro.old_logps is not None else logps.detach()
        weights = self._sampling_weights(old, micro) if micro.sampling_logps is not None else None
        parts = policy_loss(logps, old, micro.ref_logps, micro.advantages, micro.mask, self.loss_config,
                            micro.token_normalizer, micro.seq_normalizer, weights, entropies)
        self.run_state.metrics["kl"].append(parts.kl)
        self.run_state.metrics["clip_ratio"].append(parts.clip_ratio)
        if micro.mask.any():  # every optimiser step, also the later passes over a rollout
            self.run_state.metrics["entropy"].append(parts.entropy)
        return parts.loss

    def _sampling_weights(self, old: torch.Tensor, micro: MicroBatch) -> torch.Tensor | None:
        """Log how far vLLM's sampling log-probs are from the training model's (first pass over a rollout:
        ``vllm/mismatch/*`` and ``vllm/logp_diff/*``) and, with ``grpo_vllm_is_correction``, the importance weights
        of ``grpo_vllm_is_mode`` (``sampler_correction``)."""
        mask = micro.mask.bool()
        if self.run_state.first_pass and mask.any():
            for key, value in mismatch(old, micro.sampling_logps, mask).items():
                self.run_state.metrics[f"vllm/{key}" if key.startswith("logp_diff") else f"vllm/mismatch/{key}"].append(value)
        if not self.grpo_args.grpo_vllm_is_correction:
            return None
        weights = importance_weights(old, micro.sampling_logps, mask, self.grpo_args.grpo_vllm_is_mode,
                                     self.grpo_args.grpo_vllm_is_cap)
        if self.run_state.first_pass and mask.any():
            kept = weights.expand_as(old)[mask]
            self.run_state.metrics["vllm/is_weight/mean"].append(float(kept.mean()))
            self.run_state.metrics["vllm/is_weight/min"].append(float(kept.min()))
            self.run_state.metrics["vllm/is_weight/max"].append(float(kept.max()))
            self.run_state.metrics["vllm/is_masked_ratio"].append(float((kept == 0).double().mean()))
        return weights

    def _token_logps(self, model: Any, inputs: dict[str, Any], completion_ids: torch.Tensor, entropy: bool = False,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and with ``entropy``, entropies) of the completion tokens under softmax(logits / T) with the
        vision tokens suppressed, i.e. the distribution that was sampled (``token_stats``). A shared-prefix forward
        must run inside ``_shared_attention``. Trajectory rows (``agent_rows``) carry the positions to keep, and
        ``completion_ids`` are then the tokens those positions predict."""
        layout = inputs.get(shared_prefix.KWARG)
        actions = inputs.get(ACTION_INDEX)  # trajectory rows: logits only where an action token is predicted
        if actions is not None:
            inputs = {key: value for key, value in inputs.items() if key != ACTION_INDEX}
            logits = model(**inputs, logits_to_keep=actions, use_cache=False).logits
            if logits.size(1) == inputs["input_ids"].size(1):  # the model ignores logits_to_keep (4.57's Qwen2-VL)
                logits = logits[:, actions]
        else:
            keep = completion_ids.size(1) + 1 if layout is None else layout.keep
            logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
            if logits.size(1) == inputs["input_ids"].size(1):  # the model ignores logits_to_keep (4.57's Qwen2-VL)
                logits = logits[:, -keep:] if layout is None else logits[:, keep]
            logits = logits[:, :-1, :] if layout is None else shared_prefix.unpack_logits(logits, layout)
        banned = torch.tensor(self.suppressed, device=logits.device, dtype=torch.long)
        rows = [row_logps_and_entropy(row_logits, row_ids, banned, self.temperature, entropy, entropy_grad)
                for row_logits, row_ids in zip(logits, completion_ids)]
        logps = torch.stack([row for row, _ in rows])
        return logps, torch.stack([row for _, row in rows]) if entropy else None

    def _reference_logps(self, model: Any, inputs: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        if self.ref_model is not None:
            return self._token_logps(self.ref_model, inputs, ids)[0]
        with reference_context(self.accelerator.unwrap_model(model)):
            return self._token_logps(model, inputs, ids)[0]
