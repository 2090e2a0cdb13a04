"""A video for vLLM's OpenAI server in a model folder's training frame and clock, prepared by the client.

vLLM samples a ``video_url`` itself: by the header's frame count at 2 fps (not the folder's policy), resized by the
checkpoint's video processor (Qwen3: a budget over the whole clip), stamped from those frames (measured on vLLM
0.28: another frame and stamps 0.25 s off on a 10-fps clip). Its ``video/jpeg`` data URL instead takes frames as
they are, with the metadata of a request's ``media_io_kwargs``. So the client samples and sizes the clip exactly as
training did (``read_clip`` under the folder's recorded video policy), sends the frames as lossless PNGs, their
times as ``frames_indices`` at a rate whose integer indices keep every printed ``<t seconds>`` stamp, and
``do_resize: false`` where the checkpoint's clip budget would resize them (``server_resizes``); images in such a
request go pre-sized too (``vllm_image_part``). The server needs nothing of this package.

Every family's clock: the Qwen3 stamps (times as integer indices), Qwen2.5-VL's seconds (the sampled rate as
``fps``, so vLLM's ``second_per_grid_ts`` is the plan's) and Qwen2-VL's group index. vLLM places the text after a
video at its largest position + 1, where a model trained under the plugin saw it (``frame.mrope``). One video per
request: the metadata is the request's, not the video's. vLLM 0.32 takes a request's ``media_io_kwargs`` only on a server started with
``--trust-request-mm-kwargs``.
"""

from __future__ import annotations

import base64
import importlib
import io
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.policy_record import folder_policy, folder_video, read_policy_record
from llamafactory_qwenvl_patch.frame.video import VideoPlan, video_processor_kwargs
from llamafactory_qwenvl_patch.image_io.images import ImageError, model_input_image
from llamafactory_qwenvl_patch.image_io.processor_sizes import keep_processor_class_sizes
from llamafactory_qwenvl_patch.image_io.video import read_clip

TIME_BASES = (1_000, 10_000, 100_000, 1_000_000)  # indices per second tried, coarsest first


class VideoRequestError(ValueError):
    """A video (or folder) that cannot be sent to vLLM in the training frame and clock; the message says why."""


def _png_data(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _stamps(indices: list[int], rate: int) -> list[str]:
    """What vLLM's Qwen3 processor prints for integer ``indices`` at ``rate`` (each pair's mean time)."""
    times = [index / rate for index in indices]
    return [f"<{(times[i] + times[i + 1]) / 2:.1f} seconds>" for i in range(0, len(times), 2)]


def integer_times(plan: VideoPlan) -> tuple[int, list[int]]:
    """(rate, indices): the plan's frame times as integers at the coarsest rate that keeps every printed stamp."""
    for rate in TIME_BASES:
        indices = [round(t * rate) for t in plan.frames_indices]
        if _stamps(indices, rate) == plan.stamp_texts:
            return rate, indices
    raise VideoRequestError(f"no integer time base up to {TIME_BASES[-1]} per second prints this clip's stamps "
                            f"{plan.stamp_texts[:4]}...; vLLM takes integer frame indices only")


def vllm_video_request(video: Any, folder: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(content part, extra_body) of a chat request to vLLM's OpenAI server serving ``folder``: the clip (a path, a
    frame list or a stream) sampled and sized by the folder's recorded video policy, with its clock."""
    found = folder_video(folder)
    if found is None:
        raise VideoRequestError(f"{folder} records no video policy (qwenvl_policy.json without 'video'): export it "
                                "from a qwenvl_patch run")
    policy, frame_list_fps = found
    frames, plan = read_clip(video, policy, frame_list_fps)
    if plan.clock == "stamps":
        rate, indices = integer_times(plan)
        clock = {"fps": float(rate), "frames_indices": indices, "total_num_frames": max(indices) + 1}
    else:  # Qwen2.5-VL's seconds per group, temporal patch / fps, is the plan's whole number (``VideoPlan.metadata``)
        clock = {key: plan.metadata(len(frames))[key] for key in ("fps", "frames_indices", "total_num_frames")}
    part = {"type": "video_url",
            "video_url": {"url": "data:video/jpeg;base64," + ",".join(_png_data(frame) for frame in frames)}}
    extra: dict[str, Any] = {"media_io_kwargs": {"video": {
        "num_frames": -1, **clock, "duration": plan.duration, "do_sample_frames": False}}}
    kwargs = video_processor_kwargs([plan])
    if not server_resizes(folder, len(frames), frames[0].height, frames[0].width):
        del kwargs["do_resize"]
    if kwargs:
        extra["mm_processor_kwargs"] = kwargs
    return part, extra


def server_resizes(folder: str | Path, frames: int, height: int, width: int) -> bool:
    """Whether the folder's own video processor would resize frames already in the frame: a Qwen3 clip of t x h x w
    outside its ``size`` budget, or a Qwen2/2.5-VL frame outside its per-frame bounds. Only then does the request
    carry ``do_resize: false``, which newer vLLM (0.32) accepts from a request only on a server started with
    ``--trust-request-mm-kwargs``."""
    import transformers
    from transformers import AutoVideoProcessor

    keep_processor_class_sizes()
    processor = AutoVideoProcessor.from_pretrained(str(folder))
    size = dict(processor.size)
    factor = processor.patch_size * processor.merge_size
    module = "qwen2_vl.image_processing_qwen2_vl" if type(processor).__name__.startswith("Qwen2VL") else \
        "qwen3_vl.video_processing_qwen3_vl"
    try:
        smart_resize = importlib.import_module(f"transformers.models.{module}").smart_resize
    except (ImportError, AttributeError):
        raise VideoRequestError(f"transformers {transformers.__version__} has no transformers.models.{module}."
                                "smart_resize, which says whether the server would resize the clip") from None
    if module.startswith("qwen2_vl"):  # bounds on each frame
        return smart_resize(height, width, factor, size["shortest_edge"], size["longest_edge"]) != (height, width)
    return smart_resize(frames, height, width, processor.temporal_patch_size, factor, size["shortest_edge"],
                        size["longest_edge"]) != (height, width)


def vllm_image_part(image: Any, folder: str | Path) -> dict[str, Any]:
    """An image content part already in ``folder``'s training frame, for a request that also carries a
    ``vllm_video_request`` video (whose ``do_resize: false`` applies to the request's images too)."""
    if read_policy_record(folder) is None:
        raise ImageError(f"{folder} has no qwenvl_policy.json: export it from a qwenvl_patch run")
    policy = folder_policy(folder, None)
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + _png_data(model_input_image(image, policy))}}
