"""Patches ``llamafactory.data.loader``: a pinned run refuses datasets converted for another frame and checks every
image and clip before LF's preprocessing workers read them, so a mismatch stops the run up front instead of training
on misplaced coordinates."""

from __future__ import annotations

from contextvars import ContextVar
from types import ModuleType
from typing import Any, Callable

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.integration import lf_compat
from llamafactory_qwenvl_patch.integration.patching import _replace


# ``qwenvl_preflight_decode_videos`` of the run whose ``get_dataset`` is running (its pre-flight sees no model_args)
_DECODE_VIDEOS: ContextVar[bool] = ContextVar("qwenvl_preflight_decode_videos", default=False)


class StampMismatchError(ValueError):
    """A dataset converted for another resize policy or coordinate convention than this run's."""


def check_dataset_stamps(model_args: Any, data_args: Any, policy: ResizePolicy, video: Any = None,
                         frame_list_fps: float | None = None) -> None:
    """Refuse datasets whose ``qwenvl_policy`` stamp differs from the run (its video policy too, for a dataset
    converted with videos); warn about unstamped ones."""
    from llamafactory.extras import logging as lf_logging

    from llamafactory_qwenvl_patch.frame.families import resolve_family
    from llamafactory_qwenvl_patch.frame.stamp import differences, read_dataset_info, run_stamp, stamp_of

    names = [*(data_args.dataset or []), *(data_args.eval_dataset or [])]
    info = read_dataset_info(data_args.dataset_dir) if names else {}
    family = resolve_family(model_args.model_name_or_path, data_args.template).name
    run = run_stamp(policy, family, video, frame_list_fps)
    logger = lf_logging.get_logger("llamafactory.qwenvl_patch")
    for name in names:
        entry = info.get(name)
        stamp = stamp_of(entry) if isinstance(entry, dict) else None
        if stamp is None:
            logger.warning_rank0(
                f"dataset {name!r} has no qwenvl_policy stamp: its coordinates cannot be checked against this run "
                f"({run.describe()}). Convert it with `qwenvl-prep convert --from-yaml` to stamp it."
            )
            continue
        diff = differences(stamp, run)
        if diff:
            raise StampMismatchError(
                f"dataset {name!r} in {data_args.dataset_dir}/dataset_info.json was converted for another frame:\n"
                f"  dataset: {stamp.describe()}\n  run:     {run.describe()}\n  differs in: {'; '.join(diff)}\n"
                f"Re-run `qwenvl-prep convert --from-yaml <this yaml>` on the original data, or train with the "
                f"dataset's bounds."
            )


def patch_data_loader(data_loader: ModuleType) -> None:
    """Check dataset stamps and every image of a pinned run up front, before LF's workers touch them."""
    lf_compat.require(data_loader, ["_get_preprocessed_dataset", "get_dataset"])

    def make_get_dataset(get_dataset: Callable) -> Callable:
        def wrapper(template: Any, model_args: Any, data_args: Any, *args: Any, **kwargs: Any) -> Any:
            plugin = getattr(template, "mm_plugin", None)
            policy = getattr(plugin, "policy", None)
            if getattr(model_args, "qwenvl_patch", False) and isinstance(policy, ResizePolicy):
                check_dataset_stamps(model_args, data_args, policy, getattr(plugin, "video_policy", None),
                                     getattr(plugin, "qwenvl_frame_list_fps", None))
            token = _DECODE_VIDEOS.set(bool(getattr(model_args, "qwenvl_preflight_decode_videos", False)))
            try:
                return get_dataset(template, model_args, data_args, *args, **kwargs)
            finally:
                _DECODE_VIDEOS.reset(token)

        return wrapper

    _replace(data_loader, "get_dataset", make_get_dataset)

    def make(get_preprocessed: Callable) -> Callable:
        def wrapper(dataset: Any, data_args: Any, training_args: Any, stage: Any, template: Any, *args, **kwargs):
            from llamafactory_qwenvl_patch.integration.plugin import _PinnedStills

            plugin = getattr(template, "mm_plugin", None)
            if dataset is not None and isinstance(plugin, _PinnedStills):
                from llamafactory_qwenvl_patch.integration.preflight import check_dataset_records

                _check_media(dataset, data_args, plugin)
                check_dataset_records(dataset, template, args[0] if args else kwargs.get("tokenizer"), data_args,
                                      plugin.policy, sft=stage == "sft")
            return get_preprocessed(dataset, data_args, training_args, stage, template, *args, **kwargs)

        return wrapper

    _replace(data_loader, "_get_preprocessed_dataset", make)


def _check_media(dataset: Any, data_args: Any, plugin: Any) -> None:
    """Every image and clip checked (``preflight.check_dataset_media``); clips stored rotated logged in one warning."""
    from llamafactory.extras import logging as lf_logging

    from llamafactory_qwenvl_patch.integration.preflight import MAX_LISTED, check_dataset_media
    from llamafactory_qwenvl_patch.integration.preflight_videos import VideoCheck

    video = getattr(plugin, "video_policy", None)
    videos = None if video is None else VideoCheck(video, plugin.qwenvl_frame_list_fps, _DECODE_VIDEOS.get())
    notes = check_dataset_media(dataset, plugin.policy, getattr(data_args, "media_dir", None), videos)
    if notes:
        more = f"\n  ... and {len(notes) - MAX_LISTED} more" if len(notes) > MAX_LISTED else ""
        lf_logging.get_logger("llamafactory.qwenvl_patch").warning_rank0(
            f"{len(notes)} clip(s) stored rotated:\n  " + "\n  ".join(notes[:MAX_LISTED]) + more)
