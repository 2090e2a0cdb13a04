"""Patches LF's inference: ``llamafactory.chat.chat_model`` (images checked, answers mapped to the request's
pixels), ``llamafactory.chat.hf_engine`` (M-RoPE token types for transformers 5.x), ``llamafactory.chat.vllm_engine``
(each video's clock handed to vLLM) and ``llamafactory.api.chat`` (a refused image is a 400, not a crash)."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable

from llamafactory_qwenvl_patch.integration import lf_compat
from llamafactory_qwenvl_patch.integration.patching import _replace


def _frame_of(chat_model: Any) -> Any:
    return getattr(getattr(getattr(chat_model, "engine", None), "tokenizer", None), "qwenvl_serving", None)


def _video_frame_of(chat_model: Any) -> Any:
    """(video policy, frame-list rate) of a pinned chat model's template plugin, None when it has none."""
    plugin = getattr(getattr(getattr(chat_model, "engine", None), "template", None), "mm_plugin", None)
    policy = getattr(plugin, "video_policy", None)
    return None if policy is None else (policy, plugin.qwenvl_frame_list_fps)


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


def patch_api_chat(api_chat: ModuleType) -> None:
    """The OpenAI-style API: a request whose image is unreadable or refused by the pinned policy is a 400 with the
    reason, checked before the response starts (so streaming requests get it too); the server stays up. Local media
    paths are read only inside SAFE_MEDIA_PATH, by resolved path, with one answer for every refusal; media
    placeholders typed as text are a 400 (LF: a 500). A video data URL of every container the plugin reads is
    decoded (LF's pattern knows four names), any other data URL LF would not decode is a 400 naming its type."""
    lf_compat.require(api_chat, ["_process_request", "create_chat_completion_response",
                                 "create_stream_chat_completion_response"])
    common = lf_compat.require_module("llamafactory.api.common", ["SAFE_MEDIA_PATH", "ALLOW_LOCAL_FILES"])
    constants = lf_compat.require_module("llamafactory.extras.constants",
                                         ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "AUDIO_PLACEHOLDER"])
    placeholders = (constants.IMAGE_PLACEHOLDER, constants.VIDEO_PLACEHOLDER, constants.AUDIO_PLACEHOLDER)

    def validate(request: Any, chat_model: Any) -> None:
        frame = _frame_of(chat_model)
        if frame is None:
            return
        from fastapi import HTTPException, status
        from PIL.Image import DecompressionBombError
        from PIL import UnidentifiedImageError

        from llamafactory_qwenvl_patch.image_io.images import ImageError
        from llamafactory_qwenvl_patch.integration.api_checks import (
            MEDIA_REFUSED, literal_placeholders, refused_local_media, relabel_video_data_urls, template_tokens,
            unread_data_url_message, unread_data_urls,
        )
        from llamafactory_qwenvl_patch.integration.serving import check_images, check_videos

        unread = unread_data_urls(request)
        if unread:
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST, detail=unread_data_url_message(*unread[0]))
        relabel_video_data_urls(request)  # the request LF's own handler reads next
        if refused_local_media(request, common.SAFE_MEDIA_PATH, common.ALLOW_LOCAL_FILES) is not None:
            raise HTTPException(status_code=status.HTTP_403_FORBIDDEN, detail=MEDIA_REFUSED)
        forged = template_tokens(request)
        if forged:
            where, token = forged[0]
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST,
                                detail=f"{where} holds {token!r} as text, a token of the model's chat "
                                       "template: the tokenizer would read it as that token (a forged turn end, or an "
                                       "image or video slot with nothing in it), not as text; leave it out")
        typed = literal_placeholders(request, placeholders)
        if typed:
            index, tag = typed[0]
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST,
                                detail=f"message {index} holds {tag} as text: LLaMA-Factory reads it as a media slot "
                                       "and finds no media for it; send media as content parts (image_url, video_url, "
                                       f"audio_url) and leave {tag} out of the text")
        try:
            # LF's _process_request pops the system message off the request it is given: a copy keeps the request
            # LF's own handler then reads whole (issue 41, item 1: a pinned server dropped every system prompt)
            _, _, _, images, videos, _ = api_chat._process_request(request.model_copy(deep=True))
            check_images(frame, images)
            # a stream's status goes out before the model reads the clips: decode its sampled frames here, so a
            # clip damaged past its packets is a 400 too (a request that is not streamed is answered 400 when the
            # plugin's own decode fails: ``make``)
            check_videos(_video_frame_of(chat_model), videos, decode=bool(getattr(request, "stream", False)))
        except ImageError as exc:
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST, detail=str(exc)) from None
        except (UnidentifiedImageError, ValueError, OSError, DecompressionBombError) as exc:
            raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST,
                                detail=f"image in the request cannot be read: {exc}") from None

    def make(create: Callable) -> Callable:
        async def wrapper(request: Any, chat_model: Any) -> Any:
            from llamafactory_qwenvl_patch.image_io.images import ImageError

            validate(request, chat_model)
            try:
                return await create(request, chat_model)
            except ImageError as exc:  # a clip whose frames do not decode, found as the plugin reads it
                if _frame_of(chat_model) is None:
                    raise
                from fastapi import HTTPException, status

                raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST, detail=str(exc)) from None

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


def patch_vllm_engine(vllm_engine: ModuleType) -> None:
    """LF's vLLM inference engine hands vLLM each video's frames alone: vLLM then stamps Qwen3's groups and sets
    Qwen2.5-VL's seconds per group by its own defaults, not the frames' times. Under the pinned plugin each video goes
    with its plan's metadata, not resampled, and the request with ``video_processor_kwargs`` (the clock the GRPO
    rollouts and ``predict --backend vllm`` check against vLLM's)."""
    lf_compat.require(vllm_engine, ["VllmEngine"])
    engine_cls = vllm_engine.VllmEngine
    lf_compat.require(engine_cls, ["_generate"])
    generate_request = engine_cls._generate
    if getattr(generate_request, "__qwenvl_wrapped__", False):
        return

    @functools.wraps(generate_request)
    async def generate_pinned(self, *args: Any, **kwargs: Any) -> Any:
        plugin = getattr(self.template, "mm_plugin", None)
        if getattr(plugin, "video_policy", None) is None:
            return await generate_request(self, *args, **kwargs)
        import numpy as np

        from llamafactory_qwenvl_patch.frame.video import video_processor_kwargs
        from llamafactory_qwenvl_patch.grpo.generation.vllm_video import swapped

        plans: list[Any] = []
        regularize, model_generate = plugin._regularize_videos, self.model.generate

        def with_clock(videos: list[Any], **options: Any) -> dict[str, Any]:
            data = regularize(videos, **options)
            plans.extend(data["plans"])
            items = [plan.vllm_item(np.stack([np.asarray(frame.convert("RGB")) for frame in frames]))
                     for frames, plan in zip(data["videos"], data["plans"])]
            return {**data, "videos": items}

        def with_kwargs(prompt: dict[str, Any], *rest: Any, **options: Any) -> Any:
            if plans:
                kwargs = video_processor_kwargs(plans)
                if "video_metadata" in kwargs and len(plans) > 1:  # LF's engine keeps vLLM's processor cache
                    raise ValueError(f"{len(plans)} videos in one request: a Qwen2-VL / Qwen2.5-VL clock goes to "
                                     "vLLM once per request (video_processor_kwargs); send one video per request")
                prompt = {**prompt, "mm_processor_kwargs": kwargs}
            return model_generate(prompt, *rest, **options)

        # LF's _generate awaits nothing before it calls generate: no other request runs while these are swapped
        with swapped(plugin, "_regularize_videos", with_clock), swapped(self.model, "generate", with_kwargs):
            return await generate_request(self, *args, **kwargs)

    generate_pinned.__qwenvl_wrapped__ = True
    engine_cls._generate = generate_pinned
