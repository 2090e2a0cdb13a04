"""Resuming ``GRPOTrainer`` as the same run: the GRPO state saved with each checkpoint and restored before the
first step, the sampler's epoch, the completions log trimmed and the complete-marker (``resume``)."""

from __future__ import annotations

import logging
import os
from collections import defaultdict

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from llamafactory_qwenvl_patch.grpo.algorithm.reference import saving_trained_adapter_only
from llamafactory_qwenvl_patch.grpo.trainer import resume
from llamafactory_qwenvl_patch.grpo.trainer.metrics import COMPLETIONS
from llamafactory_qwenvl_patch.grpo.trainer.rollout_phase import RolloutMixin

logger = logging.getLogger("llamafactory.qwenvl_patch.grpo")


class _SamplerEpoch(TrainerCallback):
    """Give the rollout sampler the epoch number. Trainer's ``set_epoch`` on the dataloader does not reach it after a
    resume (accelerate's skip wrapper stops two levels short), and a resumed epoch must replay the same order."""

    def __init__(self, trainer: RolloutMixin) -> None:
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.trainer.rollout_sampler is not None:
            self.trainer.rollout_sampler.set_epoch(int(state.epoch + 1e-6) if state.epoch else 0)


class _Resumable(TrainerCallback):
    """A relaunch continues the same run: rows logged after the checkpoint it resumes from are dropped from
    completions.jsonl, and each checkpoint gets its complete-marker last (after the processor and every rank's
    files), so a checkpoint a kill cuts short is never resumed from; ``save_total_limit`` removes older checkpoints
    only then, so one complete checkpoint always remains (``resume``)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if args.should_save:
            step = state.global_step
            resume.trim_jsonl(os.path.join(args.output_dir, COMPLETIONS), lambda row: row.get("step", 0) < step)

    def on_save(self, args, state, control, **kwargs):
        self.trainer.accelerator.wait_for_everyone()
        if args.should_save:
            resume.mark_complete(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"),
                                 state.global_step)
            resume.rotate(args.output_dir, args.save_total_limit, state.best_model_checkpoint)


def _require_trainer_hooks() -> None:
    """The Trainer methods a resumed run relies on (``_save_checkpoint`` and ``_load_rng_state`` are overridden);
    if transformers renamed them, resuming would silently sample a new rollout."""
    import transformers

    missing = [name for name in ("_save_checkpoint", "_load_rng_state") if not callable(getattr(Trainer, name, None))]
    if missing:
        raise RuntimeError(f"transformers {transformers.__version__} has no Trainer.{', Trainer.'.join(missing)}, "
                           "which stage: grpo overrides to resume a run as the same run; install the tested set "
                           "(pip install -c constraints.txt)")


class CheckpointMixin:
    def _layout(self) -> dict[str, int]:
        return {"steps_per_generation": self.steps_per_generation, "num_iterations": self.num_iterations,
                "gradient_accumulation_steps": self.grad_accum, "world_size": self.accelerator.num_processes}

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint plus this rank's GRPO state: the rollout when the checkpoint falls inside its
        reuse window, the counters and the metrics not logged yet (``resume``). A marker left by an earlier save of
        this step (a run resumed from before it) goes first."""
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            resume.forget_marker(folder)
        super()._save_checkpoint(model, trial)
        within_window = self.run_state.micro_step % (self.steps_per_generation * self.num_iterations) != 0
        resume.save_state(folder, self.args.process_index, {
            "layout": self._layout(), "micro_step": self.run_state.micro_step,
            "buffer": self.run_state.buffer if within_window else None, "metrics": dict(self.run_state.metrics),
            "flat_rollouts": self.run_state.flat_rollouts, "reported_rewards": sorted(self.run_state.reported_rewards)})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Called once when a run resumes, before its first step: restore the GRPO state saved with the checkpoint,
        so a checkpoint inside a reuse window continues with the same rollout."""
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        state = resume.load_state(checkpoint, self.args.process_index, self.accelerator.device)
        round_length = self.steps_per_generation * self.num_iterations
        if state is None or state["layout"] != self._layout():
            if self.off_policy and self.state.global_step * self.grad_accum % round_length:
                logger.warning(f"{checkpoint} lies inside a rollout's reuse window but holds no rollout for this "
                               "layout (written by an older version, or with other grpo_* or world-size settings): "
                               "a new rollout is sampled, so this run will not continue as the interrupted one")
            return
        self.run_state.micro_step = state["micro_step"]
        self.run_state.buffer = state["buffer"]
        self.run_state.metrics = defaultdict(list, state["metrics"])
        self.run_state.flat_rollouts = state["flat_rollouts"]
        self.run_state.reported_rewards = set(state["reported_rewards"])

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        with saving_trained_adapter_only(self.accelerator.unwrap_model(self.model)):
            super()._save(output_dir, state_dict)
