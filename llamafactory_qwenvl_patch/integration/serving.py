"""Serving in the training frame: a pinned model folder is served with its own bounds by default, answers can come
back in the pixels of the image the client sent, and an image the policy refuses is a client error.

Used by the LF patches of ``get_infer_args`` (api, chat, webchat, export, ``ChatModel``), of ``ChatModel`` and of
the OpenAI-style API; everything here is plain functions over LF's objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from llamafactory_qwenvl_patch.scoring.answers import AnswerError, parse_answer
from llamafactory_qwenvl_patch.image_io.images import ImageError, open_image
from llamafactory_qwenvl_patch.frame.policy_record import POLICY_FILE, read_policy_record
from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy, convert_coords

ANSWER_COORDS = ("model", "original")


class FrameConflictError(ValueError):
    """The YAML's bounds differ from the frame the model folder was trained in."""


class NotServableError(ValueError):
    """A pinned model folder that the chosen inference backend would not load, or not in the training frame."""


def folder_policy(model_args: Any) -> tuple[str, dict[str, Any]] | None:
    """(folder, record) of the frame the weights were last trained in: the last adapter that carries
    ``qwenvl_policy.json``, else the model folder. An adapter trained at other bounds than its base (a resolution
    curriculum, or a user's choice) is used in its own frame."""
    folders = [*reversed(getattr(model_args, "adapter_name_or_path", None) or []), model_args.model_name_or_path]
    for folder in folders:
        record = read_policy_record(folder)
        if record is not None:
            return str(folder), record
    return None


def resolve_frame(model_args: Any, explicit: set[str]) -> str | None:
    """Decide the frame of an inference run and set it on ``model_args``; returns a line to log, or None.

    ``qwenvl_patch: false`` keeps stock LF. A folder with ``qwenvl_policy.json`` is pinned to its own bounds unless
    the YAML opts out; bounds the YAML gives that differ from the folder's are an error showing both.
    """
    if "qwenvl_patch" in explicit and not model_args.qwenvl_patch:
        return None
    found = folder_policy(model_args)
    if found is None:
        return None
    folder, record = found
    trained = (int(record["min_pixels"]), int(record["max_pixels"]))
    given = {key: getattr(model_args, key) for key in ("image_min_pixels", "image_max_pixels") if key in explicit}
    wanted = dict(zip(("image_min_pixels", "image_max_pixels"), trained))
    conflicts = [f"{key}: YAML {given[key]}, folder {wanted[key]}" for key in given if int(given[key]) != wanted[key]]
    if conflicts:
        raise FrameConflictError(
            f"{folder} was trained in the frame min_pixels={trained[0]}, max_pixels={trained[1]} "
            f"({POLICY_FILE}), but the YAML asks for another: {'; '.join(conflicts)}. Remove those keys (inference "
            "and export then use the training frame), or set `qwenvl_patch: false` for stock LLaMA-Factory (boxes "
            "will drift).")
    video = _video_keys(folder)
    video_conflicts = [f"{key}: YAML {getattr(model_args, key)}, folder {value}" for key, value in video.items()
                       if key in explicit and float(getattr(model_args, key)) != float(value)]
    if video_conflicts:
        raise FrameConflictError(
            f"{folder} was trained with the video policy {record['video']} ({POLICY_FILE}), but the YAML asks for "
            f"another: {'; '.join(video_conflicts)}. Remove those keys (inference and export then use the training "
            "video frame and clock), or set `qwenvl_patch: false` for stock LLaMA-Factory.")
    model_args.image_min_pixels, model_args.image_max_pixels = trained
    for key, value in video.items():
        setattr(model_args, key, value)
    model_args.qwenvl_patch = True
    return (f"{folder} carries {POLICY_FILE}: running in its training frame (min_pixels={trained[0]}, "
            f"max_pixels={trained[1]}{', and its video policy' if video else ''}); `qwenvl_patch: false` opts out")


def _video_keys(folder: str) -> dict[str, Any]:
    """LF's video keys (and the frame-list rate) of a folder's recorded video policy ({} for a folder trained
    before videos were pinned)."""
    from llamafactory_qwenvl_patch.frame.policy_record import folder_video

    found = folder_video(folder)
    if found is None:
        return {}
    video, frame_list_fps = found
    return {"video_min_pixels": video.min_pixels, "video_max_pixels": video.max_pixels, "video_fps": video.fps,
            "video_maxlen": video.max_frames, "qwenvl_frame_list_fps": frame_list_fps}


def check_backend_reads(model_args: Any) -> None:
    """A pinned run on ``infer_backend: vllm``: the folder must be one the installed vLLM loads in the training
    frame, else one error naming each file and key and the repair command, instead of vLLM's traceback at start-up
    (or a silently other frame). LF formats prompts with its own template, so the folder's chat template is not
    needed."""
    backend = getattr(model_args, "infer_backend", None)
    if not model_args.qwenvl_patch or str(getattr(backend, "value", backend)) != "vllm":
        return
    from pathlib import Path

    from llamafactory_qwenvl_patch.frame.families import family_of_model
    from llamafactory_qwenvl_patch.model_files.folder import ModelFolder, NotPortableError
    from llamafactory_qwenvl_patch.model_files.readers import READERS, reader_problems, vllm_reader

    folder = model_args.model_name_or_path
    if family_of_model(folder) is None:
        return
    reader = vllm_reader(None)
    try:
        problems = reader_problems(ModelFolder.load(Path(folder)), reader, chat=False)
    except NotPortableError as exc:
        problems = [str(exc)]
    if problems:
        raise NotServableError(
            f"{folder} would not load in {READERS[reader]} as the training frame needs:\n  " + "\n  ".join(problems)
            + f"\nRepair it with `qwenvl-prep fix-config {folder} --target vllm` (backups kept), or re-export it "
            "with `qwenvl_patch: true`, which writes the portable layout.")


@dataclass(frozen=True)
class ServingFrame:
    """What a pinned inference engine needs to check images and map answers: the policy, the convention the model
    answers in (``model`` or ``rel1000``) and what the client gets (``model`` or ``original``)."""

    policy: ResizePolicy
    convention: str
    answer_coords: str = "model"


def image_size(source: Any) -> tuple[int, int]:
    """(height, width) of an LF image input; ImageError (naming it) when it is unusable."""
    image = open_image(source)
    return image.height, image.width


def check_images(frame: ServingFrame, images: Sequence[Any] | None) -> None:
    """Every image must open and be representable by the policy (aspect ratio, size): else ImageError."""
    for index, source in enumerate(images or []):
        try:
            frame.policy.model_size(*image_size(source))
        except PolicyError as exc:
            raise ImageError(f"image {index + 1} of the request: {exc}") from None


def check_videos(video: tuple[Any, float] | None, videos: Sequence[Any] | None, decode: bool = False) -> None:
    """Every video must open and be sampled by the video policy (``(policy, frame-list rate)``): else a
    ``VideoFileError`` (an ImageError) naming it. Probing reads packets only; ``decode`` also decodes the sampled
    frames (a clip whose packets are whole but whose frame data is not)."""
    if video is None:
        return
    from llamafactory_qwenvl_patch.image_io.video import VideoFileError, probe, read_clip, rewindable

    policy, frame_list_fps = video
    for index, source in enumerate(videos or []):
        try:
            stream = rewindable(source)  # once: an http(s) clip's response body is read a single time
            clip = probe(stream, frame_list_fps)
            clip.plan(policy)
            if decode:
                read_clip(stream, policy, frame_list_fps, transform=lambda frame: None, clip=clip)
        except (VideoFileError, PolicyError) as exc:
            raise VideoFileError(f"video {index + 1} of the request: {exc}") from None


def to_original(frame: ServingFrame, text: str, images: Sequence[Any] | None) -> str:
    """The answer with every box and point in the pixels of the request's image (the model's text otherwise).

    Only for exactly one image: with several, a coordinate cannot be tied to an image, so the text is left in the
    model's frame; with none, there is no frame to map into. Malformed answers are returned as they are.
    """
    if frame.answer_coords != "original" or len(images or []) != 1:
        return text
    orig_hw = image_size(images[0])
    model_hw = frame.policy.model_size(*orig_hw)
    try:
        parsed = parse_answer(text)
    except AnswerError:
        return text
    return parsed.rewrite(lambda item: convert_coords(item.coords, frame.convention, "orig", orig_hw, model_hw))
