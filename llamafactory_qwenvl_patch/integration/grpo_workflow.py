"""``stage: grpo`` workflow: LF's tokenizer, template, dataset (``stage="ppo"``: prompt + reference answer), model
loading and callbacks, with our GRPOTrainer."""

from __future__ import annotations

import os
from collections import deque
from typing import Any

from llamafactory_qwenvl_patch.integration import lf_compat


def _log_callback_class():
    """LF's LogCallback writes a fixed set of keys to trainer_log.jsonl; this one adds the GRPO metrics."""
    callbacks = lf_compat.require_module("llamafactory.train.callbacks", ["LogCallback"])
    constants = lf_compat.require_module("llamafactory.extras.constants", ["TRAINER_LOG"])
    lf_compat.require(callbacks.LogCallback, ["_write_log", "on_log", "on_train_begin"])
    from llamafactory_qwenvl_patch.grpo.trainer.resume import trim_jsonl

    class GRPOLogCallback(callbacks.LogCallback):
        EXTRA_PREFIXES = ("reward", "rewards/", "frac_reward_zero_std", "kl", "clip_ratio", "completion_length/",
                          "parse_failures", "truncated_ratio", "vision_tokens_cut", "groups_skipped", "blank/", "vllm/",
                          "memory/", "monitor/", "entropy", "dynamic/", "agent/", "eval_")

        def __init__(self) -> None:
            super().__init__()
            self._extras: deque = deque()

        def on_train_begin(self, args, state, control, **kwargs):
            """A resumed run drops the rows a killed run logged after its checkpoint, so each step appears once."""
            if args.should_save:
                step = state.global_step
                trim_jsonl(os.path.join(args.output_dir, constants.TRAINER_LOG),
                           lambda row: row.get("current_steps", 0) <= step)
            return super().on_train_begin(args, state, control, **kwargs)

        def on_log(self, args, state, control, **kwargs):
            if args.should_save:
                last = state.log_history[-1] if state.log_history else {}
                self._extras.append({k: v for k, v in last.items() if k.startswith(self.EXTRA_PREFIXES)})
            return super().on_log(args, state, control, **kwargs)

        def _write_log(self, output_dir: str, logs: dict[str, Any]) -> None:
            extras = self._extras.popleft() if self._extras else {}
            return super()._write_log(output_dir, {**logs, **extras})

    return GRPOLogCallback


def lf_callbacks(model_args: Any, data_args: Any, training_args: Any, finetuning_args: Any,
                 generating_args: Any) -> list[Any]:
    """The callbacks LF's ``_training_function`` adds for every stage, in its order (PiSSA conversion, SwanLab, early
    stopping, torch and module profilers, the reporter last), with our log callback in place of LF's, after the
    check that ``output_dir`` is still the folder this run locked."""
    from transformers import EarlyStoppingCallback

    from llamafactory_qwenvl_patch.integration.checkpoint_guard import OutputDirStillLocked

    cb = lf_compat.require_module("llamafactory.train.callbacks", [
        "ReporterCallback", "PissaConvertCallback", "TorchProfilerCallback", "ModuleProfilerCallback"])
    callbacks: list[Any] = [OutputDirStillLocked(), _log_callback_class()()]
    if finetuning_args.pissa_convert:
        callbacks.append(cb.PissaConvertCallback())
    if finetuning_args.use_swanlab:
        utils = lf_compat.require_module("llamafactory.train.trainer_utils", ["get_swanlab_callback"])
        callbacks.append(utils.get_swanlab_callback(finetuning_args))
    if finetuning_args.early_stopping_steps is not None:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=finetuning_args.early_stopping_steps))
    if getattr(training_args, "enable_torch_profiler", False):
        callbacks.append(cb.TorchProfilerCallback(training_args))
    if getattr(training_args, "profile_modules", None):
        callbacks.append(cb.ModuleProfilerCallback(training_args.profile_modules))
    callbacks.append(cb.ReporterCallback(model_args, data_args, finetuning_args, generating_args))
    return callbacks


def grpo_training_function(config: dict[str, Any]) -> None:
    """LF's ``_training_function`` for ``stage: grpo``: same argument parsing, callbacks and teardown (under Ray,
    Ray destroys the process group)."""
    import torch.distributed as dist

    hparams = lf_compat.require_module("llamafactory.hparams", ["get_train_args"])
    parser = lf_compat.require_module("llamafactory.hparams.parser", ["read_args"])
    from llamafactory_qwenvl_patch.integration.yaml_keys import explicit_keys

    raw_args = parser.read_args(config.get("args"))
    model_args, data_args, training_args, finetuning_args, generating_args = hparams.get_train_args(raw_args)
    callbacks = list(config.get("callbacks") or [])
    callbacks += lf_callbacks(model_args, data_args, training_args, finetuning_args, generating_args)
    run_grpo(model_args, data_args, training_args, finetuning_args, generating_args, callbacks,
             explicit_keys(raw_args))
    packages = lf_compat.require_module("llamafactory.extras.packages", ["is_ray_available"])
    if packages.is_ray_available():
        import ray

        if ray.is_initialized():
            return
    if dist.is_initialized():
        dist.destroy_process_group()


def _index(dataset: Any) -> Any:
    return dataset.add_column("grpo_index", list(range(len(dataset))))


def _vllm_engine(model_args, data_args, training_args, finetuning_args, policy, sampling, template, tokenizer,
                 model) -> Any:
    """The colocated vLLM engine, in the run's frame: the pinned policy, which ``qwenvl_patch: true`` gives (the
    parser refuses vLLM rollouts without it: ``grpo.args.check_with_other_keys``)."""
    from llamafactory_qwenvl_patch.grpo.generation.settings import vision_token_ids
    from llamafactory_qwenvl_patch.grpo.generation.vllm_engine import VLLMEngine, VLLMSettings

    prompts = training_args.per_device_train_batch_size * (finetuning_args.grpo_steps_per_generation or 1)
    settings = VLLMSettings(
        gpu_memory_utilization=finetuning_args.grpo_vllm_gpu_memory_utilization,
        tensor_parallel_size=finetuning_args.grpo_vllm_tensor_parallel_size,
        # an agent's trajectory: the task, every screenshot and every action, one screenshot per turn
        max_model_len=finetuning_args.grpo_agent_max_tokens if finetuning_args.grpo_agent_env else
        data_args.cutoff_len + sampling["max_new_tokens"],
        images_per_prompt=max(8, finetuning_args.grpo_agent_max_turns) if finetuning_args.grpo_agent_env else 8,
        max_num_seqs=max(prompts, training_args.per_device_eval_batch_size) * finetuning_args.grpo_num_generations * 2,
        # one seed per engine: the ranks of a tensor-parallel group must sample alike
        seed=training_args.seed + training_args.process_index // finetuning_args.grpo_vllm_tensor_parallel_size,
        dtype=str(model.dtype).removeprefix("torch."),
    )
    return VLLMEngine(model_args.model_name_or_path, policy, settings, sampling,
                      template.get_stop_token_ids(tokenizer), vision_token_ids(tokenizer),
                      finetuning_args.grpo_num_generations, model.config.image_token_id)


def _agent_run(finetuning_args: Any, template: Any, tokenizer: Any, processor: Any, policy: Any) -> Any:
    """The agent settings of ``grpo_agent_*`` and the turn renderer: LF's template (its plugin pinned to the run's
    frame), tokenizer, processor and image placeholder."""
    constants = lf_compat.require_module("llamafactory.extras.constants", ["IMAGE_PLACEHOLDER"])
    from llamafactory_qwenvl_patch.grpo.args import agent_env_kwargs
    from llamafactory_qwenvl_patch.grpo.rollout.turns import TurnRenderer
    from llamafactory_qwenvl_patch.grpo.trainer.agent_play import AgentRun

    fa = finetuning_args
    return AgentRun(fa.grpo_agent_env, agent_env_kwargs(fa.grpo_agent_env_kwargs), fa.grpo_agent_max_turns,
                    fa.grpo_agent_max_tokens, fa.grpo_agent_step_timeout, fa.grpo_agent_isolation,
                    fa.grpo_agent_max_env_failures,
                    TurnRenderer(template, tokenizer, processor, policy, constants.IMAGE_PLACEHOLDER),
                    fa.grpo_agent_credit, fa.grpo_agent_step_weight, fa.grpo_agent_gamma)


def grpo_resume_point(training_args: Any, explicit: bool, logger: Any) -> Any:
    """The checkpoint to resume from. LF's automatic resume takes the highest-numbered ``checkpoint-N`` folder, even
    one a kill cut short (every relaunch then crashed): those are skipped with a warning naming each, for the last
    complete one (or step 0). A checkpoint named in ``resume_from_checkpoint`` that is incomplete is an error. The
    checkpoint chosen is verified against its marker's checksums; a changed file is an error naming it."""
    from llamafactory_qwenvl_patch.grpo.trainer.resume import checkpoint_problem, last_complete, verify

    chosen = training_args.resume_from_checkpoint
    if not isinstance(chosen, str):
        return chosen
    if explicit:
        reason = checkpoint_problem(chosen)
        if reason is not None:
            raise ValueError(f"resume_from_checkpoint {chosen} cannot be resumed from: {reason}")
        verify(chosen)
        return chosen
    best, skipped = last_complete(training_args.output_dir)
    for folder, reason in skipped:
        logger.warning_rank0(f"skipping {folder}: {reason}; it was cut short (a kill while it was written?) and is "
                             "never resumed from")
    if skipped:
        logger.warning_rank0(f"resuming from {best}" if best else "no complete checkpoint: training from step 0")
    if best is not None:
        verify(best)
    return best


def run_grpo(model_args, data_args, training_args, finetuning_args, generating_args, callbacks,
             explicit: set[str] = frozenset()) -> None:
    """``explicit``: the keys the user set (sampling keys they did not set get GRPO's no-truncation defaults; a
    ``resume_from_checkpoint`` they did not set was LF's automatic choice)."""
    data = lf_compat.require_module("llamafactory.data", ["MultiModalDataCollatorForSeq2Seq", "get_dataset",
                                                          "get_template_and_fix_tokenizer"])
    model_mod = lf_compat.require_module("llamafactory.model", ["load_model", "load_tokenizer"])
    trainer_utils = lf_compat.require_module("llamafactory.train.trainer_utils", ["create_ref_model"])
    lf_callbacks = lf_compat.require_module("llamafactory.train.callbacks", ["SaveProcessorCallback"])
    constants = lf_compat.require_module("llamafactory.extras.constants", ["IGNORE_INDEX"])
    logging_mod = lf_compat.require_module("llamafactory.extras.logging", ["get_logger"])

    from llamafactory_qwenvl_patch.frame.families import resolve_family
    from llamafactory_qwenvl_patch.grpo.algorithm.reference import add_reference_adapter, record_trainable_adapter_loads
    from llamafactory_qwenvl_patch.grpo.generation.settings import sampling_settings, vision_token_ids
    from llamafactory_qwenvl_patch.grpo.rewards.registry import load_rewards
    from llamafactory_qwenvl_patch.grpo.rollout.collate import GRPOCollator
    from llamafactory_qwenvl_patch.grpo.trainer.prompt_order import check_prompt_count
    from llamafactory_qwenvl_patch.grpo.trainer.trainer import GRPOTrainer
    from llamafactory_qwenvl_patch.integration.grpo_meta import carrying_meta

    logger = logging_mod.get_logger("llamafactory.qwenvl_patch.grpo")
    rewards = load_rewards(finetuning_args.reward_funcs, finetuning_args.reward_weights, finetuning_args.cheat_rules)
    sampling, warnings = sampling_settings(generating_args, explicit)
    for warning in warnings:
        logger.warning_rank0(warning)
    tokenizer_module = model_mod.load_tokenizer(model_args)
    tokenizer, processor = tokenizer_module["tokenizer"], tokenizer_module["processor"]
    template = data.get_template_and_fix_tokenizer(tokenizer, data_args)
    with carrying_meta():
        dataset_module = data.get_dataset(template, model_args, data_args, training_args, stage="ppo",
                                          **tokenizer_module)
    train_dataset = _index(dataset_module["train_dataset"])
    eval_dataset = dataset_module.get("eval_dataset")
    if isinstance(eval_dataset, dict):
        eval_dataset = {name: _index(part) for name, part in eval_dataset.items()}
    elif eval_dataset is not None:
        eval_dataset = _index(eval_dataset)
    if training_args.do_train and train_dataset is not None and hasattr(train_dataset, "__len__"):
        check_prompt_count(len(train_dataset), training_args.per_device_train_batch_size
                           * (finetuning_args.grpo_steps_per_generation or training_args.gradient_accumulation_steps),
                           training_args.world_size)  # before the model loads
    with record_trainable_adapter_loads() as resumed:
        model = model_mod.load_model(tokenizer, model_args, finetuning_args, training_args.do_train)
    if resumed and finetuning_args.grpo_beta != 0:
        add_reference_adapter(model, resumed[-1], model_args.adapter_folder)
        logger.info_rank0(f"GRPO reference: the starting adapter {resumed[-1]} (frozen copy), not the base model.")
    tokenizer.padding_side = "left"
    collator = GRPOCollator(data.MultiModalDataCollatorForSeq2Seq(
        template=template, model=model, label_pad_token_id=constants.IGNORE_INDEX, **tokenizer_module), tokenizer)
    ref_model = None
    if finetuning_args.grpo_beta != 0 and finetuning_args.finetuning_type != "lora":
        ref_model = trainer_utils.create_ref_model(model_args, finetuning_args)
    training_args.remove_unused_columns = False
    if processor is not None:
        callbacks.append(lf_callbacks.SaveProcessorCallback(processor))
    policy = getattr(processor, "qwenvl_policy", None)
    engine = None
    if finetuning_args.grpo_rollout_backend == "vllm":
        engine = _vllm_engine(model_args, data_args, training_args, finetuning_args, policy, sampling, template,
                              tokenizer, model)
    agent = _agent_run(finetuning_args, template, tokenizer, processor, policy) if finetuning_args.grpo_agent_env \
        else None
    trainer = GRPOTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        data_collator=collator, callbacks=callbacks, finetuning_args=finetuning_args, sampling=sampling,
        reward_funcs=rewards, ref_model=ref_model, resize_policy=policy, vllm_engine=engine, agent=agent,
        coords=resolve_family(model_args.model_name_or_path, data_args.template).coords, stop_token_ids=template.get_stop_token_ids(tokenizer),
        suppress_token_ids=vision_token_ids(tokenizer), processor=processor, tokenizer=tokenizer,
    )
    if training_args.do_train:
        training_args.resume_from_checkpoint = grpo_resume_point(training_args,
                                                                 "resume_from_checkpoint" in explicit, logger)
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
        if trainer.is_world_process_zero() and finetuning_args.plot_loss:
            from llamafactory.extras.ploting import plot_loss

            plot_loss(training_args.output_dir, keys=["loss", "reward", "kl", "completion_length/mean"])
    if training_args.do_eval and eval_dataset is not None:
        metrics = trainer.evaluate(metric_key_prefix="eval")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
