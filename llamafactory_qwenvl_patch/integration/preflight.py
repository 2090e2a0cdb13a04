"""Up-front media check of a pinned training run: every bad image and clip is reported at once, by sample and file.

Runs before LLaMA-Factory's tokenization workers, where a bad file would otherwise surface as a PIL or PyAV stack
trace from a ``datasets.map`` worker, one file per attempt. Clips are probed by ``preflight_videos``.
"""

from __future__ import annotations

import mmap
import os
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

from PIL import Image

from llamafactory_qwenvl_patch.image_io import jpeg
from llamafactory_qwenvl_patch.image_io.images import ImageError, describe, file_kind, open_image
from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy
from llamafactory_qwenvl_patch.integration.preflight_videos import (
    ClipResult, VideoCheck, check_clip, clip_key, rotation_note,
)

MAX_LISTED = 20


class DatasetMediaError(ValueError):
    """One or more samples of the training data have unusable images or clips."""


def png_complete(data: bytes | mmap.mmap) -> bool:
    """True when every PNG chunk's CRC holds and the IDAT stream inflates to its end (CRCs alone pass a file whose
    compressed data was damaged before the CRCs were written)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return False
    inflater, i, end = zlib.decompressobj(), 8, len(data)
    try:
        while i + 12 <= end:
            length = int.from_bytes(data[i:i + 4], "big")
            kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + length]
            if len(body) != length or i + 12 + length > end:
                return False
            if zlib.crc32(body, zlib.crc32(kind)) != int.from_bytes(data[i + 8 + length:i + 12 + length], "big"):
                return False
            if kind == b"IDAT":
                while body:  # inflate in bounded pieces: memory stays flat on a decompression bomb
                    inflater.decompress(body, 1 << 20)
                    body = inflater.unconsumed_tail
            if kind == b"IEND":
                return inflater.eof
            i += 12 + length
    except zlib.error:
        return False
    return False


@contextmanager
def _file_bytes(source: Any) -> Iterator[bytes | mmap.mmap | None]:
    """The bytes of an image source without reading them into Python (mmap for files); None when not at hand."""
    if isinstance(source, dict):
        source = source.get("bytes") or source.get("path")
    if isinstance(source, bytes):
        yield source
        return
    if isinstance(source, str) and source.startswith("file://"):
        source = source[len("file://"):]
    if not isinstance(source, (str, os.PathLike)) or not os.path.getsize(source):
        yield None
        return
    with open(source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        yield data


_STRUCTURAL = {"JPEG": jpeg.is_complete, "PNG": png_complete}


def check_image(source: Any, policy: ResizePolicy) -> None:
    """Raise ImageError if the image is missing, unreadable, truncated, corrupt or outside the policy's aspect limit.

    Fast for healthy data, since it runs at every training start: JPEG and PNG get a structural check that reads the
    file but decodes nothing (``jpeg.is_complete``, ``png_complete``); other formats (GIF, TIFF, BMP, WebP, ...) have no
    cheap check and are decoded.
    """
    name = describe(source)
    image = open_image(source)
    try:
        policy.model_size(image.height, image.width)
    except PolicyError as exc:
        raise ImageError(f"image {name}: {exc}") from None
    try:
        if isinstance(source, Image.Image):
            image.load()
            return
        check = _STRUCTURAL.get(image.format)
        if check is None:
            image.load()
            return
        with _file_bytes(source) as data:
            if data is not None and not check(data):
                raise ImageError(f"image {name}: the {image.format} data is truncated or corrupt")
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError(f"image {name}: cannot decode ({exc}); the file is truncated or corrupt") from None


def _prompt_excerpt(prompt: Any) -> str:
    try:
        text = " ".join(str(message.get("content", "")) for message in prompt or [])
    except AttributeError:
        text = str(prompt)
    text = " ".join(text.split())
    return text[:60] + ("..." if len(text) > 60 else "")


def lf_path_problem(kind: str, path: Any, media_dir: str | None) -> str | None:
    """Why a media path of LF's aligned dataset is not the file the dataset meant, or None. LF 0.9.5's converter
    (``_find_medias``) takes ``media_dir/path`` only when ``os.path.isfile`` says it is a regular file, and otherwise
    keeps ``path`` as written, relative to the working directory: a FIFO or a folder in ``media_dir`` then sends LF
    to a same-named file in the working directory, or to "file not found" naming neither place."""
    if not isinstance(path, str) or not media_dir or os.path.isabs(path) or "://" in path:
        return None
    meant = os.path.join(media_dir, path)
    try:
        mode = os.stat(meant).st_mode
    except (OSError, ValueError):
        if os.path.islink(meant):  # a link that points nowhere: meant as the file, and LF would read another
            return (f"{kind} {meant}: is a broken symbolic link (to {os.readlink(meant)}); LLaMA-Factory then reads "
                    f"{path} relative to the working directory ({os.getcwd()}) instead")
        if os.path.lexists(path):
            return None  # LF reads the working directory's file, as it documents
        return f"{kind} {path}: file not found (in media_dir {media_dir} nor in the working directory {os.getcwd()})"
    if stat.S_ISREG(mode):
        return None
    return (f"{kind} {meant}: is {file_kind(mode)}, not a regular file; LLaMA-Factory then reads {path} relative "
            f"to the working directory ({os.getcwd()}) instead")


def _image_problem(source: Any, policy: ResizePolicy, media_dir: str | None) -> str | None:
    problem = lf_path_problem("image", source, media_dir)
    if problem is not None:
        return problem
    try:
        check_image(source, policy)
    except ImageError as exc:
        return str(exc)
    return None


def _column(dataset: Any, name: str) -> list[Any]:
    return dataset[name] if name in dataset.column_names else [None] * len(dataset)


def _problems(dataset: Any, policy: ResizePolicy, media_dir: str | None, videos: VideoCheck | None
              ) -> tuple[list[str], list[str], list[str]]:
    """(image problems, video problems, rotated-clip notes), each problem naming its sample."""
    prompts = _column(dataset, "_prompt")
    image_jobs = [(index, source) for index, sources in enumerate(_column(dataset, "_images"))
                  for source in sources or []]
    video_jobs = [] if videos is None else [(index, video) for index, clips in enumerate(_column(dataset, "_videos"))
                                            for video in clips or []]
    clips = {clip_key(video): video for _, video in video_jobs}

    def named(index: int, problem: str) -> str:
        return f"sample {index} ({_prompt_excerpt(prompts[index])!r}): {problem}"

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        images = pool.map(lambda job: _image_problem(job[1], policy, media_dir), image_jobs, chunksize=64)
        image_problems = [named(index, problem) for (index, _), problem in zip(image_jobs, images) if problem]
        results: dict[Any, ClipResult] = dict(zip(clips, pool.map(
            lambda video: check_clip(video, videos, lambda path: lf_path_problem("video", path, media_dir)),
            clips.values())))
    video_problems = [named(index, results[clip_key(video)].problem) for index, video in video_jobs
                      if results[clip_key(video)].problem]
    notes = [rotation_note(clips[key], result.display) for key, result in results.items()
             if not result.display.shown_as_stored]
    return image_problems, video_problems, notes


def check_dataset_media(dataset: Any, policy: ResizePolicy, media_dir: str | None = None,
                        videos: VideoCheck | None = None) -> list[str]:
    """Raise DatasetMediaError listing the samples with unusable images, and clips when ``videos`` says how the run
    reads them; ``media_dir`` is LF's (``data_args.media_dir``), against which it resolved relative paths. Returns a
    note per clip stored rotated. Streaming datasets are skipped (no random access)."""
    column_names = getattr(dataset, "column_names", None) or []
    if not {"_images", "_videos"} & set(column_names) or not hasattr(dataset, "__len__"):
        return []
    image_problems, video_problems, notes = _problems(dataset, policy, media_dir, videos)
    problems = image_problems + video_problems
    if problems:
        counts = " and ".join(f"{len(found)} {kind} problem(s)" for kind, found
                              in (("image", image_problems), ("video", video_problems)) if found)
        listed = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        hint = ("" if not video_problems or videos.decode else
                "\nClips were probed, not decoded: qwenvl_preflight_decode_videos: true also decodes their sampled "
                "frames.")
        raise DatasetMediaError(
            f"{counts} in the training data (sample = 0-based index in the merged dataset):\n  {listed}{more}\n"
            f"Fix or drop these samples (`qwenvl-prep check` lists them too).{hint}"
        )
    return notes


def check_dataset_records(dataset: Any, template: Any, tokenizer: Any, data_args: Any, policy: ResizePolicy,
                          sft: bool = True) -> None:
    """Raise DatasetRecordError listing records with chat-template tokens written as text and, for SFT (``sft``),
    misplaced or miscounted media placeholders or image tokens ``cutoff_len`` would cut (``preflight_records``);
    streaming datasets are skipped."""
    from llamafactory_qwenvl_patch.integration import lf_compat
    from llamafactory_qwenvl_patch.integration.preflight_records import DatasetRecordError, record_problems

    column_names = getattr(dataset, "column_names", None) or []
    if "_prompt" not in column_names or not hasattr(dataset, "__len__"):
        return
    constants = lf_compat.require_module("llamafactory.extras.constants",
                                         ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "AUDIO_PLACEHOLDER"])
    utils = lf_compat.require_module("llamafactory.data.processor.processor_utils", ["infer_seqlen"])
    lf_compat.require(template, ["encode_multiturn", "mm_plugin"])
    lf_compat.require(template.mm_plugin, ["image_token", "vision_bos_token", "vision_eos_token"])
    tags = {"image": constants.IMAGE_PLACEHOLDER, "video": constants.VIDEO_PLACEHOLDER,
            "audio": constants.AUDIO_PLACEHOLDER}
    problems = [f"sample {index} ({_prompt_excerpt(prompt)!r}): {problem}" for index, prompt, problem
                in record_problems(dataset, template, tokenizer, data_args, policy, tags, utils.infer_seqlen, sft)]
    if problems:
        listed = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise DatasetRecordError(
            f"{len(problems)} record problem(s) in the training data (sample = 0-based index in the merged "
            f"dataset):\n  {listed}{more}\nFix or drop these samples (`qwenvl-prep check` lists them too).")
