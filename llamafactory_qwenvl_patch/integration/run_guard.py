"""What a training run settles before anything loads (under ``qwenvl_patch``, and every ``stage: grpo`` run): one
``output_dir`` for every node (``shared_storage``), no other run in it (``run_lock``), the checkpoint it resumes
complete (``grpo.resume``) and of the same kind of run, and its adapters of its model (``run_identity``).

Global rank 0 decides and every rank gets its answer, or its error: a multi-rank run stops on every rank with one
message, and never with ranks that chose different checkpoints. The resume point of ``stage: grpo`` is chosen again,
the same way, by its workflow (which logs the checkpoints skipped and verifies the chosen one); here it is compared.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator

from llamafactory_qwenvl_patch.grpo.trainer import resume
from llamafactory_qwenvl_patch.integration.checkpoint_guard import GUARDED
from llamafactory_qwenvl_patch.integration.rank_zero import on_rank_zero

_TRAINING: ContextVar[bool] = ContextVar("qwenvl_training_run", default=False)


@contextmanager
def training_run() -> Iterator[None]:
    """Around LF's training function (``tuner_patch``): the arguments parsed inside it are a run about to train, which
    the guard may lock and record in its ``output_dir``; a parse anywhere else writes nothing."""
    token = _TRAINING.set(True)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def guards(model_args: Any, training_args: Any, finetuning_args: Any) -> bool:
    """Whether a parsed run is one the plugin guards: about to train, under ``qwenvl_patch`` or ``stage: grpo``."""
    return (_TRAINING.get() and training_args.do_train
            and (getattr(model_args, "qwenvl_patch", False) or finetuning_args.stage == "grpo"))


def guard_run(explicit: set[str], model_args: Any, data_args: Any, training_args: Any, finetuning_args: Any) -> None:
    """Called on every rank right after LF parsed the training arguments (``explicit``: the keys the user wrote);
    sets the resume point of the stages LF trains."""
    from llamafactory_qwenvl_patch.integration.shared_storage import check_shared_output_dir

    check_shared_output_dir(training_args.output_dir)
    chosen = on_rank_zero(lambda: _settle("resume_from_checkpoint" in explicit, model_args, data_args,
                                           training_args, finetuning_args))
    if finetuning_args.stage != "grpo":
        training_args.resume_from_checkpoint = chosen
    GUARDED.add(str(Path(training_args.output_dir).resolve()))


def _settle(explicit: bool, model_args: Any, data_args: Any, training_args: Any, finetuning_args: Any) -> str | None:
    """Rank 0: lock ``output_dir``, choose the checkpoint to resume, refuse one (or an adapter) of another kind of
    run, name one another launch wrote, then record this run; returns the checkpoint."""
    from llamafactory.extras import logging as lf_logging

    from llamafactory_qwenvl_patch.integration.run_identity import (
        check_adapters, check_resume, launch_settings, other_launch, run_identity,
    )
    from llamafactory_qwenvl_patch.integration.run_lock import lock_output_dir

    logger = lf_logging.get_logger("llamafactory.qwenvl_patch")
    output_dir = training_args.output_dir
    warning = lock_output_dir(output_dir)
    if warning:
        logger.warning_rank0(warning)
    identity = run_identity(model_args, data_args, finetuning_args)
    check_adapters(model_args.adapter_name_or_path, identity)
    chosen = _resume_point(explicit, training_args, finetuning_args, logger)
    launch = launch_settings(model_args, data_args, training_args)
    if chosen is not None:
        check_resume(chosen, identity, explicit)
        line = other_launch(chosen, launch)
        if line:
            logger.warning_rank0(line)
        adopt = Path(chosen).parent.resolve() == Path(output_dir).resolve()
        if adopt and not Path(chosen, resume.MARKER).is_file():  # written before markers: keep it resumable here
            resume.mark_complete(chosen, json.loads(Path(chosen, "trainer_state.json").read_text())["global_step"])
    resume.write_run_record(output_dir, identity, launch)
    return chosen


def _resume_point(explicit: bool, training_args: Any, finetuning_args: Any, logger: Any) -> str | None:
    """The complete checkpoint the run resumes from, chosen, checked and logged as ``stage: grpo`` does. For GRPO
    LF's automatic choice is only found here: its workflow chooses it again, logging and verifying."""
    from llamafactory_qwenvl_patch.integration.grpo_workflow import grpo_resume_point

    if finetuning_args.stage != "grpo" or explicit:
        return grpo_resume_point(training_args, explicit, logger)
    chosen = training_args.resume_from_checkpoint
    return resume.last_complete(training_args.output_dir)[0] if isinstance(chosen, str) else None
