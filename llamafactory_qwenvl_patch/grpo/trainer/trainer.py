"""GRPOTrainer: a transformers Trainer, so DeepSpeed, checkpointing, resume, logging and LF's callbacks keep working.

Rollout and optimisation are two steps, as in trl, verl and EasyR1. Every ``grpo_steps_per_generation`` x
``grpo_num_iterations`` micro-steps a rollout takes the rank's generation batch (``per_device_train_batch_size`` x
``grpo_steps_per_generation`` prompts), samples G completions per prompt, scores them, computes advantages, the old
and reference log-probs and the step normalisers, and stores one ``MicroBatch`` per micro-step; each micro-step then
optimises its stored micro-batch with the clipped surrogate. With ``grpo_num_iterations > 1`` the same rollout is
optimised again and the ratio to the old log-probs (and clipping) acts.

The trainer is put together from one mixin per concern: ``rollout_phase`` (sampling and scoring a rollout),
``refill`` (DAPO's dynamic sampling), ``step`` (the loss on a stored micro-batch), ``metrics`` (evaluation and
logging) and ``checkpoint`` (resuming as the same run); its own state is ``state.RunState``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import GenerationConfig, Trainer

from llamafactory_qwenvl_patch.frame.mrope import needs_token_types
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.grpo.algorithm.losses import LossConfig
from llamafactory_qwenvl_patch.grpo.rewards.registry import Reward
from llamafactory_qwenvl_patch.grpo.rollout import shared_prefix
from llamafactory_qwenvl_patch.grpo.trainer.agent_phase import AgentMixin
from llamafactory_qwenvl_patch.grpo.trainer.agent_play import AgentRun, AgentShutdown
from llamafactory_qwenvl_patch.grpo.trainer.checkpoint import (
    CheckpointMixin,
    _require_trainer_hooks,
    _Resumable,
    _SamplerEpoch,
)
from llamafactory_qwenvl_patch.grpo.trainer.metrics import MetricsMixin
from llamafactory_qwenvl_patch.grpo.trainer.prompt_order import RolloutSampler
from llamafactory_qwenvl_patch.grpo.trainer.refill import RefillMixin
from llamafactory_qwenvl_patch.grpo.trainer.rollout_phase import RolloutMixin
from llamafactory_qwenvl_patch.grpo.trainer.state import RunState
from llamafactory_qwenvl_patch.grpo.trainer.step import StepMixin
from llamafactory_qwenvl_patch.scoring.clicks import ClickMonitorTally

CLICK_REWARDS = ("click", "click_dense")


class GRPOTrainer(RolloutMixin, AgentMixin, RefillMixin, StepMixin, MetricsMixin, CheckpointMixin, Trainer):
    def __init__(self, *, finetuning_args: Any, sampling: dict[str, Any], reward_funcs: list[Reward],
                 ref_model: Any, resize_policy: ResizePolicy | None, coords: str, stop_token_ids: list[int],
                 suppress_token_ids: list[int], processor: Any, tokenizer: Any, vllm_engine: Any = None,
                 agent: AgentRun | None = None, **kwargs: Any) -> None:
        _require_trainer_hooks()
        super().__init__(processing_class=processor or tokenizer, **kwargs)
        self.model_accepts_loss_kwargs = False  # Trainer divides each micro-batch loss by the accumulation steps
        self.grpo_args = finetuning_args  # LF's FinetuningArguments with the grpo_* keys (``args``)
        self.tokenizer = tokenizer
        self.reward_funcs = reward_funcs
        self.resize_policy = resize_policy
        self.coords = coords
        self.num_generations = finetuning_args.grpo_num_generations
        self.grad_accum = self.args.gradient_accumulation_steps
        # a multiple of grad_accum, and load_best_model_at_end needs a GRPO metric: checked when the keys are parsed
        # (grpo.args.check_with_other_keys)
        self.steps_per_generation = finetuning_args.grpo_steps_per_generation or self.grad_accum
        self.num_iterations = finetuning_args.grpo_num_iterations
        self.off_policy = self.num_iterations > 1 or self.steps_per_generation > self.grad_accum
        self.stop_token_ids = stop_token_ids
        self.suppressed = suppress_token_ids
        self.drop_ids = {*stop_token_ids, tokenizer.pad_token_id}
        common = dict(eos_token_id=stop_token_ids, pad_token_id=tokenizer.pad_token_id, use_cache=True,
                      suppress_tokens=suppress_token_ids or None)
        self.generation_config = GenerationConfig(do_sample=True, num_return_sequences=self.num_generations,
                                                  **sampling, **common)
        self.greedy_config = GenerationConfig(do_sample=False, num_return_sequences=1,
                                              max_new_tokens=sampling["max_new_tokens"], **common)
        self.max_new_tokens = self.generation_config.max_new_tokens
        self.temperature = float(self.generation_config.temperature)
        fa = finetuning_args
        self.agent = agent
        # dr_grpo's constant: the most action tokens a completion (an agent's trajectory) can hold
        longest = self.max_new_tokens * (agent.max_turns if agent is not None else 1)
        self.loss_config = LossConfig(fa.grpo_beta, fa.grpo_epsilon, fa.grpo_epsilon_high, fa.grpo_loss_type,
                                      longest, fa.grpo_importance_sampling, fa.grpo_cispo_cap,
                                      fa.grpo_delta, fa.grpo_entropy_coef)
        config = self.model.config
        self.vision_start_id = config.vision_start_token_id
        self.image_id = config.image_token_id
        self.video_id = getattr(config, "video_token_id", None)
        self.pass_token_types = needs_token_types(self.model)  # M-RoPE positions in transformers 5.x
        image_processor = getattr(processor, "image_processor", None)
        # what turns an image grid into pixels: the pinned policy, else the processor's own (same factor)
        self.grid_frame = resize_policy or (ResizePolicy.from_processor(image_processor) if image_processor else None)
        clicks = any(reward.name in CLICK_REWARDS for reward in reward_funcs)
        self.run_state = RunState(click_monitors=ClickMonitorTally() if clicks else None)
        self.rollout_sampler: RolloutSampler | None = None
        self.vllm = vllm_engine
        self.add_callback(_SamplerEpoch(self))
        self.add_callback(_Resumable(self))  # last: its marker follows every other callback's checkpoint files
        dropout = [m.p for m in self.model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        if dropout:
            logging.getLogger("llamafactory.qwenvl_patch.grpo").warning(
                f"{len(dropout)} dropout layers (p up to {max(dropout)}) are active in training: completions are "
                "sampled without dropout but their log-probs are taken with it, so the on-policy ratio is not 1 "
                "and clipping acts on noise. Set lora_dropout: 0 (LF's default) unless you mean it.")
        self.ref_model = ref_model
        # an agent's group shares its task's root (prompt and first screenshot); its trajectories are the suffixes
        self.shared_prefix = shared_prefix.resolve(finetuning_args.grpo_shared_prefix, self._attention_models())
        if agent is not None:
            self.add_callback(AgentShutdown(self))
        if self.shared_prefix:
            for m in self._attention_models():
                shared_prefix.install(m)
        if ref_model is not None:
            if self.is_deepspeed_enabled:
                from trl.models import prepare_deepspeed

                self.ref_model = prepare_deepspeed(ref_model, self.accelerator)
            else:
                self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)
