"""Patches ``llamafactory.train.tuner``, where LF picks a stage's workflow and runs ``export_model``: ``stage: grpo``
runs the plugin's workflow, the other stages' checkpoints get the complete-marker in a guarded run
(``checkpoint_guard``), and a pinned export is written whole or not at all (``export_staging``), in the portable layout
so older transformers and vLLM read it in the training frame."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from llamafactory_qwenvl_patch.integration import lf_compat
from llamafactory_qwenvl_patch.integration.export_staging import ExportError, Staging, discard, publish
from llamafactory_qwenvl_patch.integration.model_patch import _EXPORTED, ExportWatch
from llamafactory_qwenvl_patch.integration.patching import _replace


def _stage_of(args: Any) -> str | None:
    if isinstance(args, dict):
        return args.get("stage")
    if isinstance(args, (list, tuple)):
        for i, arg in enumerate(args):
            if arg == "--stage" and i + 1 < len(args):
                return args[i + 1]
            if isinstance(arg, str) and arg.startswith("--stage="):
                return arg.split("=", 1)[1]
    return None


def patch_tuner(tuner: ModuleType) -> None:
    """Route ``stage: grpo`` to our workflow (``run_exp`` and the Ray worker look the function up at call time), give
    LF's stages the complete-marker (inert unless ``run_guard`` guards the run) and rotation that keeps a complete
    checkpoint, and make a pinned export portable."""
    lf_compat.require(tuner, ["_training_function", "export_model"])
    from llamafactory_qwenvl_patch.integration.checkpoint_guard import (
        CompleteCheckpoints,
        OutputDirStillLocked,
        guard_rotation,
    )
    from llamafactory_qwenvl_patch.integration.run_guard import training_run

    guard_rotation()

    def make(training_function: Callable) -> Callable:
        def wrapper(config: dict[str, Any]) -> None:
            with training_run():
                if _stage_of(config.get("args")) != "grpo":
                    config["callbacks"] = [*(config.get("callbacks") or []), CompleteCheckpoints(),
                                           OutputDirStillLocked()]
                    return training_function(config)
                from llamafactory_qwenvl_patch.integration.grpo_workflow import grpo_training_function

                return grpo_training_function(config)

        return wrapper

    _replace(tuner, "_training_function", make)
    _replace(tuner, "export_model", _make_export)


def _make_export(export_model: Callable) -> Callable:
    """``llamafactory-cli export`` of a pinned run: LF writes the folder aside (``export_staging``); once it has, check
    that the frame's files landed (LF only logs a failed tokenizer or processor save), put it in the portable layout
    (transformers 4.49 to 5.x and vLLM read it, in the training frame) and move it into ``export_dir``. Any failure
    removes what was written. Unpinned exports stay stock."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        watch = ExportWatch()
        token = _EXPORTED.set(watch)
        try:
            result = export_model(*args, **kwargs)
            if watch.staging is not None:
                _finish(watch, watch.staging)
            return result
        except BaseException as exc:
            if watch.staging is None:
                raise
            removed = discard(watch.staging)
            if isinstance(exc, ExportError):
                raise ExportError(f"{exc} {removed}") from None
            if isinstance(exc, OSError) or _weights_unwritten(exc):  # a file not written (a full disk, say)
                raise ExportError(f"export to {watch.staging.target} failed: {type(exc).__name__}: {exc}. "
                                  f"{removed}") from None
            from llamafactory.extras import logging as lf_logging

            lf_logging.get_logger("llamafactory.qwenvl_patch").warning_rank0(f"the export stopped: {removed}")
            raise
        finally:
            _EXPORTED.reset(token)

    return wrapper


def _weights_unwritten(exc: BaseException) -> bool:
    """safetensors' own error while writing the weights (its I/O error of a full disk is no OSError)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # an older safetensors: its errors are OSErrors
        return False
    return isinstance(exc, SafetensorError)


def _finish(watch: ExportWatch, staging: Staging) -> None:
    """The pinned export LF wrote into ``staging``: checked, made portable, moved into place."""
    from llamafactory.extras import logging as lf_logging

    problem = export_problem(watch)
    if problem:
        raise ExportError(problem)
    for folder in dict.fromkeys(watch.saved):
        _portable_export(folder, str(staging.target))
    publish(staging)
    lf_logging.get_logger("llamafactory.qwenvl_patch").info_rank0(
        f"{staging.target}: the export moved into place whole (LF wrote it into {staging.folder.name} inside)")


FRAME_FILES = ("qwenvl_policy.json", "preprocessor_config.json", "tokenizer_config.json")


def export_problem(watch: ExportWatch) -> str | None:
    """What a pinned export lacks, naming the user's ``export_dir``, the file and LF's swallowed error; None when
    complete."""
    for folder in dict.fromkeys(watch.pinned):
        failed = [(what, exc) for where, what, exc in watch.failed if where == folder]
        missing = [name for name in FRAME_FILES if not (Path(folder) / name).is_file()]
        if not failed and not missing and folder in watch.saved:
            continue
        cause = "; ".join(f"the {what} save failed: {type(exc).__name__}: {exc}" for what, exc in failed)
        lacks = f"it lacks {', '.join(missing)}" if missing else "the pinned processor was not saved"
        shown = watch.staging.target if watch.staging is not None else folder
        return (f"export to {shown} is incomplete: {lacks}{' (' + cause + ')' if cause else ''}. LF only logs "
                "\"Cannot save tokenizer\" here; without these files the folder would load in the stock frame, not "
                "the training one. Fix the cause and export again.")
    return None


def _portable_export(folder: str, shown: str) -> None:
    """Rewrite ``folder`` in the portable layout, logging under ``shown`` (the export_dir it is moved into)."""
    from llamafactory.extras import logging as lf_logging

    from llamafactory_qwenvl_patch.model_files.folder import NotPortableError
    from llamafactory_qwenvl_patch.model_files.portable import make_portable

    logger = lf_logging.get_logger("llamafactory.qwenvl_patch")
    try:
        written = make_portable(folder)
    except NotPortableError as exc:
        logger.warning_rank0(f"{shown} is exported as this transformers wrote it, which older transformers and vLLM "
                             f"may not read: {exc}. `qwenvl-prep fix-config {shown}` lists what each reader needs.")
        return
    from llamafactory_qwenvl_patch.frame.families import resolve_family
    from llamafactory_qwenvl_patch.model_files.readers import READERS, has_family

    family = resolve_family(folder)
    since = family.since_transformers
    readers = "".join(f"and {READERS[r]} " for r in ("vllm-0.11", "vllm-0.28") if has_family(r, family.name))
    logger.info_rank0(f"{shown}: written in the portable layout (transformers {since} to 5.x {readers}read it in "
                      f"the training frame); rewrote {', '.join(written['files']) or 'nothing'}")
