"""Patches ``llamafactory.model.loader``, where LF builds the processor every stage uses: a pinned run's processor
carries the resize policy (and writes it with every save, so the training frame travels with the weights), its
tokenizer the serving frame, a MoE model on CPU loads eager experts, and ``flash_attn: fa2`` gets transformers
5.6.0's missing None check; an unpinned run on a pinned folder is warned that its frame changes."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MethodType, ModuleType
from typing import Any, Callable

from llamafactory_qwenvl_patch.frame.families import LF_VIDEO_DEFAULTS
from llamafactory_qwenvl_patch.frame.mrope import pin_pretrained_positions
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.frame.policy_record import (
    set_image_processor_bounds, set_video_processor_bounds, write_policy_record,
)
from llamafactory_qwenvl_patch.image_io.processor_sizes import keep_processor_class_sizes
from llamafactory_qwenvl_patch.integration import lf_compat
from llamafactory_qwenvl_patch.integration.export_staging import Staging, stage
from llamafactory_qwenvl_patch.integration.patching import _replace

@dataclass
class ExportWatch:
    """LF's ``export_model`` catches every error of the tokenizer and processor saves and only logs "Cannot save
    tokenizer": a pinned export would then end with exit 0 and a folder without its frame. The loader and the saves
    record here what was pinned, saved and what failed, so the export's wrapper can fail by name."""

    pinned: list[str] = field(default_factory=list)  # export_dir of each pinned load (where LF writes it)
    saved: list[str] = field(default_factory=list)  # folders the pinned processor was saved into
    failed: list[tuple[str, str, BaseException]] = field(default_factory=list)  # (folder, what, error)
    staging: Staging | None = None  # the folder LF writes a pinned export into, and the user's export_dir


# what a pinned ``export_model`` loaded and saved (None outside an export)
_EXPORTED: ContextVar[ExportWatch | None] = ContextVar("qwenvl_exported", default=None)


def _recorded_save(what: str, save: Callable) -> Callable:
    """``save`` (a bound ``save_pretrained``) that records its failure in the export watch before raising."""
    def wrapper(save_directory: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return save(save_directory, *args, **kwargs)
        except Exception as exc:
            watch = _EXPORTED.get()
            if watch is not None:
                watch.failed.append((str(save_directory), what, exc))
            raise

    return wrapper


def _save_pretrained_pinned(self: Any, save_directory: str, *args: Any, **kwargs: Any) -> Any:
    """Processor save that also writes ``preprocessor_config.json`` and the policy record beside it."""
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    self.image_processor.save_pretrained(save_directory)
    write_policy_record(save_directory, self.qwenvl_policy, getattr(self, "qwenvl_video_policy", None),
                        getattr(self, "qwenvl_frame_list_fps", None))
    watch = _EXPORTED.get()
    if watch is not None:
        watch.saved.append(str(save_directory))
    return result


def pin_processor(processor: Any, model_args: Any) -> ResizePolicy:
    """Derive the run's policy, pin it on the processor, and make every save of that processor carry it."""
    if processor is None or getattr(processor, "image_processor", None) is None:
        raise ValueError(
            f"qwenvl_patch: true needs a Qwen-VL model with an image processor; "
            f"{model_args.model_name_or_path} loaded none"
        )
    image_processor = processor.image_processor
    policy = ResizePolicy.from_processor(image_processor, model_args.image_min_pixels, model_args.image_max_pixels)
    set_image_processor_bounds(image_processor, policy)
    processor.qwenvl_policy = policy
    processor.save_pretrained = _recorded_save("processor", MethodType(_save_pretrained_pinned, processor))
    _log_active(policy)
    return policy


def _pin_video_processor(processor: Any, model_args: Any, video: VideoPolicy) -> None:
    """Where the family's HF video processor bounds each frame, its bounds become the video policy's, so exports
    state the training video frame (a Qwen3 clip budget cannot: docs/video.md)."""
    from llamafactory_qwenvl_patch.frame.families import resolve_family

    video_processor = getattr(processor, "video_processor", None)
    family = resolve_family(model_args.model_name_or_path, getattr(model_args, "template", None), video.factor)
    if video_processor is not None and family.video_bounds_per_frame:
        set_video_processor_bounds(video_processor, video)


def video_policy_of(model_args: Any, policy: ResizePolicy) -> VideoPolicy:
    """The run's video policy from LF's own video keys, with the family's clock and the image policy's factor."""
    from llamafactory_qwenvl_patch.frame.families import resolve_family

    family = resolve_family(model_args.model_name_or_path, getattr(model_args, "template", None), policy.factor)
    keys = {key: getattr(model_args, key, None) for key in LF_VIDEO_DEFAULTS}
    return VideoPolicy.from_lf_keys(keys, policy.factor, family.video_clock)


def image_cache_mb_of(model_args: Any) -> int:
    """``qwenvl_image_cache_mb``: a whole number of megabytes from 0 (no store) to ``MAX_CACHE_MB``."""
    from llamafactory_qwenvl_patch.image_io.image_cache import MAX_CACHE_MB

    value = getattr(model_args, "qwenvl_image_cache_mb", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CACHE_MB:
        raise ValueError(f"qwenvl_image_cache_mb must be a whole number of megabytes from 0 to {MAX_CACHE_MB}, "
                         f"got {value!r}")
    return value


def frame_list_fps_of(model_args: Any, video: VideoPolicy) -> float:
    """``qwenvl_frame_list_fps`` (default ``video_fps``, what LF assumes), refused when it is no rate at all."""
    value = getattr(model_args, "qwenvl_frame_list_fps", None)
    if value is None:
        return video.fps
    from llamafactory_qwenvl_patch.frame.video import frame_list_times

    frame_list_times(1, value)  # a VideoError (a ValueError) naming the bounds for 0, negatives, nan, huge numbers
    return float(value)


def _log_active(policy: ResizePolicy) -> None:
    """One line per process (every torchrun rank says it), so logs show where the patch is active."""
    import os

    from llamafactory.extras import logging as lf_logging

    lf_logging.get_logger("llamafactory.qwenvl_patch").info(
        f"qwenvl_patch active (rank {os.environ.get('RANK', '0')}): still images resized with "
        f"qwen_vl_utils.fetch_image, min_pixels={policy.min_pixels}, max_pixels={policy.max_pixels}, "
        f"factor={policy.factor}"
    )


def _warn_unpinned(model_args: Any) -> None:
    """A model or adapter trained with the patch, loaded without it: its frame would silently change."""
    from llamafactory_qwenvl_patch.integration.serving import folder_policy

    found = folder_policy(model_args)
    if found:
        from llamafactory.extras import logging as lf_logging

        folder, data = found
        lf_logging.get_logger("llamafactory.qwenvl_patch").warning_rank0(
            f"{folder} was trained with qwenvl_patch (min_pixels={data.get('min_pixels')}, "
            f"max_pixels={data.get('max_pixels')}) but this run does not set `qwenvl_patch: true`: images will "
            "be resized differently from training. Add `qwenvl_patch: true` and those image_min_pixels / "
            "image_max_pixels to the YAML."
        )


def _note_new_frame(model_args: Any, policy: ResizePolicy) -> None:
    """Say so when a run's frame differs from the one its starting weights were trained in (fine for a resolution
    curriculum; what it saves carries the new frame, which inference and export then use)."""
    from llamafactory_qwenvl_patch.integration.serving import folder_policy

    found = folder_policy(model_args)
    if found is None:
        return
    folder, record = found
    before = (int(record["min_pixels"]), int(record["max_pixels"]))
    if before != (policy.min_pixels, policy.max_pixels):
        from llamafactory.extras import logging as lf_logging

        lf_logging.get_logger("llamafactory.qwenvl_patch").warning_rank0(
            f"{folder} was trained in the frame min_pixels={before[0]}, max_pixels={before[1]}; this run uses "
            f"min_pixels={policy.min_pixels}, max_pixels={policy.max_pixels}. What it saves carries the new frame "
            "(inference and export use it); keep the old bounds unless you mean to change the resolution.")


def _serving_frame(policy: ResizePolicy, model_args: Any) -> Any:
    from llamafactory_qwenvl_patch.frame.families import resolve_family
    from llamafactory_qwenvl_patch.integration.serving import ServingFrame

    family = resolve_family(model_args.model_name_or_path, factor=policy.factor)
    return ServingFrame(policy, family.coords, getattr(model_args, "qwenvl_answer_coords", "model"))


def _experts_on_cpu(config: Any, init_kwargs: dict[str, Any]) -> None:
    """A pinned MoE run on a CPU whose torch cannot run grouped_mm there loads its experts eager (see
    ``model_files.experts``), unless the caller chose an implementation."""
    import torch

    from llamafactory_qwenvl_patch.model_files.experts import experts_load_kwargs

    chosen = experts_load_kwargs(config.to_dict(), on_cpu=not torch.cuda.is_available())
    if chosen and "experts_implementation" not in init_kwargs:
        from llamafactory.extras import logging as lf_logging

        lf_logging.get_logger("llamafactory.qwenvl_patch").info_rank0(
            f"qwenvl_patch: torch {torch.__version__} has no CPU grouped_mm kernel; the experts run "
            f"experts_implementation={chosen['experts_implementation']}")
        init_kwargs.update(chosen)


def _guard_flash_attention() -> None:
    """``flash_attn: fa2`` on transformers 5.6.0 crashes on its first forward; the guard of 5.6.2 goes in first (see
    ``transformers_releases``), or the run stops here naming the way out."""
    from llamafactory_qwenvl_patch.integration.transformers_releases import guard_flash_attention_sinks

    if guard_flash_attention_sinks():
        import transformers
        from llamafactory.extras import logging as lf_logging

        lf_logging.get_logger("llamafactory.qwenvl_patch").info_rank0(
            f"qwenvl_patch: transformers {transformers.__version__}'s flash_attention_forward gets the None check "
            "of 5.6.2 (huggingface/transformers#45588), so flash_attn: fa2 runs")


def patch_model_loader(loader: ModuleType) -> None:
    lf_compat.require(loader, ["load_tokenizer", "patch_config", "load_model"])

    def make_patch_config(patch_config: Callable) -> Callable:
        def wrapper(config: Any, tokenizer: Any, model_args: Any, init_kwargs: dict[str, Any], *args: Any,
                    **kwargs: Any) -> Any:
            result = patch_config(config, tokenizer, model_args, init_kwargs, *args, **kwargs)
            if getattr(model_args, "qwenvl_patch", False):
                _experts_on_cpu(config, init_kwargs)
                if getattr(model_args, "flash_attn", None) == "fa2":
                    _guard_flash_attention()
            return result

        return wrapper

    _replace(loader, "patch_config", make_patch_config)

    def make(load_tokenizer: Callable) -> Callable:
        def wrapper(model_args: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(model_args, "qwenvl_patch", False):  # a processor's bounds must not reach the next one's
                keep_processor_class_sizes()
            module = load_tokenizer(model_args, *args, **kwargs)
            if getattr(model_args, "qwenvl_patch", False):
                policy = pin_processor(module.get("processor"), model_args)
                _note_new_frame(model_args, policy)
                module["tokenizer"].qwenvl_policy = policy
                video = video_policy_of(model_args, policy)
                processor, tokenizer = module["processor"], module["tokenizer"]
                _pin_video_processor(processor, model_args, video)
                processor.qwenvl_video_policy = tokenizer.qwenvl_video_policy = video
                processor.qwenvl_frame_list_fps = tokenizer.qwenvl_frame_list_fps = frame_list_fps_of(model_args,
                                                                                                      video)
                module["tokenizer"].qwenvl_serving = _serving_frame(policy, model_args)
                tokenizer.qwenvl_image_cache_mb = image_cache_mb_of(model_args)
                watch = _EXPORTED.get()
                if watch is not None and getattr(model_args, "export_dir", None):
                    watch.staging = stage(model_args.export_dir)  # LF reads export_dir only when it saves
                    model_args.export_dir = str(watch.staging.folder)
                    watch.pinned.append(model_args.export_dir)
                    tokenizer.save_pretrained = _recorded_save("tokenizer", tokenizer.save_pretrained)
            else:
                _warn_unpinned(model_args)
            return module

        return wrapper

    _replace(loader, "load_tokenizer", make)

    def make_load_model(load_model: Callable) -> Callable:
        def wrapper(tokenizer: Any, model_args: Any, *args: Any, **kwargs: Any) -> Any:
            model = load_model(tokenizer, model_args, *args, **kwargs)
            if getattr(model_args, "qwenvl_patch", False):
                pin_pretrained_positions(model)  # Qwen2/2.5-VL: text after a video where pretraining put it
            return model

        return wrapper

    _replace(loader, "load_model", make_load_model)
