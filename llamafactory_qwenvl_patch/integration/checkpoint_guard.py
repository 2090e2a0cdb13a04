"""Complete checkpoints for every stage LF trains under ``qwenvl_patch``, and rotation that never loses the last one.

SFT checkpoints had no complete-marker: one a full disk cut short was LF's automatic resume point on every relaunch
(``Can't find a valid checkpoint``, ``FileNotFoundError: trainer_state.json``) until it was deleted by hand.
``CompleteCheckpoints`` gives the runs ``run_guard`` guards the marker ``stage: grpo`` writes (``grpo.resume``).

``save_total_limit`` deletes old checkpoints inside ``Trainer._save_checkpoint``, before the new one's marker: with a
limit of 1 a kill in between left no complete checkpoint. In an ``output_dir`` whose run writes markers,
transformers' rotation is replaced by ``resume.rotate`` (complete checkpoints only, never the newest complete one),
which runs again once the marker is written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from llamafactory_qwenvl_patch.grpo.trainer import resume
from llamafactory_qwenvl_patch.integration.lf_compat import LFCompatError
from llamafactory_qwenvl_patch.integration.rank_zero import on_rank_zero
from llamafactory_qwenvl_patch.integration.run_lock import check_output_dir

GUARDED: set[str] = set()  # resolved output_dirs of the runs this process guards (``run_guard``)


def guarded(output_dir: str | os.PathLike) -> bool:
    return str(Path(output_dir).resolve()) in GUARDED


class CompleteCheckpoints(TrainerCallback):
    """The complete-marker of a guarded run's checkpoints, written after every ``on_save`` callback (LF adds
    ``SaveProcessorCallback``, which writes the frame's files into the checkpoint, after the callbacks it is given):
    at the next event of the training loop, once every rank has written its files. Then ``save_total_limit``'s
    rotation. A marker left by an earlier save of the step about to be saved again goes first."""

    def __init__(self) -> None:
        self._pending: str | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._mark(args, state)

    def on_step_end(self, args, state, control, **kwargs):
        self._before_save(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._mark(args, state)
        self._before_save(args, state, control)

    def on_save(self, args, state, control, **kwargs):
        self._mark(args, state)  # a loop with no event between two saves (LF's PPO)
        if guarded(args.output_dir):
            self._pending = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self._mark(args, state)

    def _before_save(self, args: Any, state: Any, control: Any) -> None:
        if control.should_save and args.should_save and guarded(args.output_dir):
            resume.forget_marker(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    def _mark(self, args: Any, state: Any) -> None:
        if self._pending is None:
            return
        from accelerate import PartialState

        folder, self._pending = self._pending, None
        PartialState().wait_for_everyone()  # every rank's files (ZeRO shards, RNG states) are written
        if args.should_save and os.path.isdir(folder):  # rotation at the end of training may have removed it
            resume.mark_complete(folder, int(folder.rsplit("-", 1)[1]))
            resume.rotate(args.output_dir, args.save_total_limit, state.best_model_checkpoint)


class OutputDirStillLocked(TrainerCallback):
    """Every guarded run, every stage: at each step's end, before its log line and checkpoint land in ``output_dir``,
    the folder is still the one this run locked (``run_lock.check_output_dir``, on global rank 0, which holds the
    lock); every rank hears rank 0's answer and stops with it, so no rank writes its shards or RNG state into a
    folder another run may hold."""

    def on_step_end(self, args, state, control, **kwargs):
        on_rank_zero(lambda: check_output_dir(args.output_dir))


def guard_rotation() -> None:
    """Route transformers' checkpoint rotation through ``resume.rotate`` in runs that write markers (a module
    function since transformers 5, ``Trainer._rotate_checkpoints`` in 4.x); stock everywhere else."""
    import transformers
    import transformers.trainer as trainer_module

    if callable(getattr(trainer_module, "rotate_checkpoints", None)):
        _wrap(trainer_module, "rotate_checkpoints", _module_rotation)
    elif callable(getattr(trainer_module.Trainer, "_rotate_checkpoints", None)):
        _wrap(trainer_module.Trainer, "_rotate_checkpoints", _method_rotation)
    else:
        raise LFCompatError(
            f"llamafactory-qwenvl-patch cannot guard checkpoint rotation in transformers {transformers.__version__}: "
            "it has neither transformers.trainer.rotate_checkpoints (5.x) nor Trainer._rotate_checkpoints (4.x), "
            "and save_total_limit could delete a run's last complete checkpoint. Install the tested set "
            "(pip install -c constraints.txt) or set QWENVL_PATCH_DISABLE=1 to run stock LLaMA-Factory.")


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    if not getattr(original, "__qwenvl_wrapped__", False):
        wrapper = make(original)
        wrapper.__qwenvl_wrapped__ = True
        setattr(owner, name, wrapper)


def _module_rotation(rotate_checkpoints: Callable) -> Callable:
    def wrapper(output_dir: str, save_total_limit: int | None = None, best_model_checkpoint: str | None = None,
                *args: Any, **kwargs: Any) -> None:
        if resume.marked_run(output_dir):
            return resume.rotate(output_dir, save_total_limit, best_model_checkpoint)
        return rotate_checkpoints(output_dir, save_total_limit, best_model_checkpoint, *args, **kwargs)

    return wrapper


def _method_rotation(rotate_checkpoints: Callable) -> Callable:
    def wrapper(self: Any, use_mtime: bool = False, output_dir: str | None = None) -> None:
        if output_dir is not None and resume.marked_run(output_dir):
            return resume.rotate(output_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
        return rotate_checkpoints(self, use_mtime=use_mtime, output_dir=output_dir)

    return wrapper
