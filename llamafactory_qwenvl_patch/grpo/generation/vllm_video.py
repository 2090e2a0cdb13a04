"""Video prompts on the vLLM rollout engine, in the training frame and clock.

vLLM is handed the frames the pinned plugin decoded for training (captured from its ``_regularize_videos`` while
LF's collator runs, so no clip is decoded twice), with the plan's metadata (``VideoPlan.metadata``: for the Qwen3
clock the sampled times as ``frames_indices`` at ``METADATA_FPS``, from which vLLM prints each group's ``<t
seconds>``; for Qwen2.5-VL's the sampled rate) and ``video_processor_kwargs``, nothing resampled or resized. The training prompt is therefore collapsed to one ``<|vision_start|><|video_pad|>
<|vision_end|>`` per video, stamps removed, and after sampling every video is checked: vLLM's grid, its pad count
and the whole prompt must be the training batch's.

Every family's clock is served: the Qwen3 stamps, Qwen2.5-VL's seconds (vLLM computes each video's
``second_per_grid_ts`` from the plan's rate, checked against the plan's) and Qwen2-VL's group index. vLLM numbers the
text after a video from the video's largest M-RoPE position + 1, the rule the models were pretrained with; the
training model follows it too under the plugin (``frame.mrope.pin_pretrained_positions``), so rollouts sample under
the positions the loss scores.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamafactory_qwenvl_patch.frame.video import VideoPlan


class VideoFrameMismatchError(RuntimeError):
    """vLLM encoded a video in another grid, with other pads or stamps than the training batch."""


@dataclass(frozen=True)
class VideoClip:
    """One video of a prompt as training encoded it: its frames, its plan and its grid in the training batch."""

    frames: np.ndarray  # (T, H, W, 3) uint8: the model-input frames, padding frame included
    plan: VideoPlan
    grid: tuple[int, int, int]  # the training batch's video_grid_thw row

    def vllm_item(self) -> tuple[np.ndarray, dict[str, Any]]:
        """vLLM's ``multi_modal_data["video"]`` item: the frames and the plan's clock (``VideoPlan.vllm_item``)."""
        return self.plan.vllm_item(self.frames)



@contextmanager
def captured_videos(plugin: Any) -> Iterator[list[tuple[Any, VideoPlan]]]:
    """Every clip the pinned plugin decodes inside the block, as (frames, plan), in decoding order."""
    method = getattr(plugin, "_regularize_videos", None)
    if method is None or not hasattr(plugin, "video_policy"):
        raise RuntimeError(f"grpo_rollout_backend: vllm needs the pinned video plugin (qwenvl_patch: true) for "
                           f"video prompts; the template's plugin is {type(plugin).__name__}")
    clips: list[tuple[Any, VideoPlan]] = []

    def recording(videos: list[Any], **kwargs: Any) -> dict[str, Any]:
        data = method(videos, **kwargs)
        clips.extend(zip(data["videos"], data["plans"]))
        return data

    with swapped(plugin, "_regularize_videos", recording):
        yield clips


def clips_per_sample(captured: list[tuple[Any, VideoPlan]], counts: list[int], grids: list[list[int]]
                     ) -> list[list[VideoClip]]:
    """The captured clips split per prompt (``counts`` videos each), with their training grids."""
    if len(captured) != sum(counts) or len(grids) != sum(counts):
        raise RuntimeError(f"the collator decoded {len(captured)} clips for {sum(counts)} videos in the batch "
                           f"({len(grids)} grids); LLaMA-Factory's collator no longer decodes each video once")
    clips = [VideoClip(np.stack([np.asarray(frame.convert("RGB")) for frame in frames]), plan, tuple(grid))
             for (frames, plan), grid in zip(captured, grids)]
    out, first = [], 0
    for count in counts:
        out.append(clips[first:first + count])
        first += count
    return out


def video_structure(clip: VideoClip, stamp_ids: Any, ids: dict[str, int], merge: int) -> list[int]:
    """The tokens of one video in a prompt. The Qwen3 clock: per group its stamp, ``<|vision_start|>``, its pads and
    ``<|vision_end|>`` (what vLLM's ``get_video_repl`` builds, stamps tokenized alone); Qwen2-VL and Qwen2.5-VL: one
    block of every group's pads."""
    t, h, w = clip.grid
    if clip.plan.clock != "stamps":
        return [ids["start"], *[ids["pad"]] * (t * h * w // merge), ids["end"]]
    pads = [ids["pad"]] * (h * w // merge)
    return [token for stamp in clip.plan.stamp_texts for token in [*stamp_ids(stamp), ids["start"], *pads, ids["end"]]]


def _stamp_length(clip: VideoClip, stamp_ids: Any) -> int:
    """Tokens of the first group's stamp, which stands before the video's first vision start (0 without stamps)."""
    return len(stamp_ids(clip.plan.stamp_texts[0])) if clip.plan.clock == "stamps" else 0


def collapse_videos(prompt: list[int], clips: list[VideoClip], stamp_ids: Any, ids: dict[str, int], merge: int,
                    index: int) -> list[int]:
    """The prompt with each video's stamps and groups replaced by one placeholder block, which vLLM expands again."""
    out, at = [], 0
    for k, clip in enumerate(clips):
        structure = video_structure(clip, stamp_ids, ids, merge)
        first = _find_group(prompt, at, ids)
        start = first - _stamp_length(clip, stamp_ids)
        if first < 0 or start < at or prompt[start:start + len(structure)] != structure:
            raise VideoFrameMismatchError(
                f"dataset record {index}: video {k}'s tokens in the training prompt are not the stamps and pads of "
                f"its plan (grid {list(clip.grid)}, stamps {clip.plan.stamps}) as vLLM writes them (each stamp "
                "tokenized on its own): a stamp merged with the text before the video? Put a space or a newline "
                "before <video>")
        out += prompt[at:start] + [ids["start"], ids["pad"], ids["end"]]
        at = start + len(structure)
    return out + prompt[at:]


def _find_group(prompt: list[int], at: int, ids: dict[str, int]) -> int:
    for i in range(at, len(prompt) - 1):
        if prompt[i] == ids["start"] and prompt[i + 1] == ids["pad"]:
            return i
    return -1


@dataclass(frozen=True)
class EncodedVideo:
    """What vLLM's processor made of one video: its grid and, on Qwen2.5-VL's clock, its seconds per group."""

    grid: list[int]
    second_per_grid_ts: float | None


def check_videos(index: int, clips: list[VideoClip], theirs: list[EncodedVideo], mine_ids: list[int],
                 their_ids: list[int], pad_id: int, merge: int) -> None:
    """vLLM's grid, seconds per group and pads of each video, and its whole prompt (stamps included), against the
    training batch's."""
    grids = [list(clip.grid) for clip in clips]
    if [list(map(int, video.grid)) for video in theirs] != grids:
        raise VideoFrameMismatchError(f"dataset record {index}: vLLM encoded its videos in grids "
                                      f"{[video.grid for video in theirs]}, training in {grids}: the rollout would "
                                      "see other frames than the loss")
    for k, (clip, video) in enumerate(zip(clips, theirs)):
        if clip.plan.clock == "seconds" and video.second_per_grid_ts != clip.plan.second_per_grid_ts:
            raise VideoFrameMismatchError(f"dataset record {index}: vLLM put video {k}'s groups "
                                          f"{video.second_per_grid_ts} s apart, training {clip.plan.second_per_grid_ts}"
                                          " s: the rollout would see another clock than the loss")
    mine, their = _pads_per_video(mine_ids, pad_id, clips), _pads_per_video(their_ids, pad_id, clips)
    expected = [t * h * w // merge for t, h, w in grids]
    if mine != expected or their != expected:
        raise VideoFrameMismatchError(f"dataset record {index}: video pads per video: vLLM {their}, training "
                                      f"{mine}, grids {grids} give {expected}")
    if their_ids != mine_ids:
        at = next(i for i, (a, b) in enumerate(zip([*mine_ids, None], [*their_ids, None])) if a != b)
        raise VideoFrameMismatchError(f"dataset record {index}: vLLM's prompt differs from the training batch's "
                                      f"from token {at} on (a video's stamps or structure): the rollout would see "
                                      "another clock than the loss")


def token_runs(ids: list[int], token_id: int) -> list[int]:
    """The length of each run of ``token_id`` in ``ids``, in order."""
    counts, run = [], 0
    for t in [*ids, None]:
        if t == token_id:
            run += 1
        elif run:
            counts.append(run)
            run = 0
    return counts


def _pads_per_video(ids: list[int], pad_id: int, clips: list[VideoClip]) -> list[int]:
    """The pad runs of ``ids`` summed per video (a Qwen3 video has one run per group, the others one run)."""
    runs = token_runs(ids, pad_id)
    out = []
    for clip in clips:
        count = clip.grid[0] if clip.plan.clock == "stamps" else 1
        out.append(sum(runs[:count]))
        runs = runs[count:]
    return out


@contextmanager
def vllm_video_grids(llm: Any, version: str) -> Iterator[list[list[EncodedVideo]]]:
    """vLLM's own encoding (``video_grid_thw``, ``second_per_grid_ts``) of each video of each request it processes
    inside the block, in order (its input processor's output, ``EngineCoreRequest.mm_features``; needs the processor
    cache off, which leaves cached items empty)."""
    processor = getattr(getattr(llm, "llm_engine", None), "input_processor", None)
    original = getattr(processor, "process_inputs", None)
    if original is None:
        raise RuntimeError(f"vLLM {version}: LLM.llm_engine.input_processor.process_inputs is gone; the GRPO video "
                           "rollout checks each video's grid through it")
    grids: list[list[EncodedVideo]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        request = original(*args, **kwargs)
        found = []
        for feature in getattr(request, "mm_features", None) or []:
            if feature.modality != "video":
                continue
            if feature.data is None or "video_grid_thw" not in feature.data:
                raise RuntimeError(f"vLLM {version}: a processed video carries no video_grid_thw (processor cache "
                                   "on?); the GRPO video rollout cannot check its grid")
            seconds = feature.data.get("second_per_grid_ts")
            found.append(EncodedVideo(feature.data["video_grid_thw"].data.reshape(-1).tolist(),
                                      None if seconds is None else float(seconds.data.reshape(-1)[0])))
        grids.append(found)
        return request

    with swapped(processor, "process_inputs", recording):
        yield grids


@contextmanager
def swapped(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """``owner.name`` is ``replacement`` inside the block, then what it was (an instance attribute or the class's)."""
    own = owner.__dict__.get(name, _MISSING)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if own is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


_MISSING = object()
