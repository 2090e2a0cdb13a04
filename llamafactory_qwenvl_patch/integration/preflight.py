"""Up-front image check of a pinned training run: every bad image is reported at once, by sample and file.

Runs before LLaMA-Factory's tokenization workers, where a bad file would otherwise surface as a PIL stack trace
from a ``datasets.map`` worker, one file per attempt.
"""

from __future__ import annotations

import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

from PIL import Image

from llamafactory_qwenvl_patch.image_io import jpeg
from llamafactory_qwenvl_patch.image_io.images import ImageError, describe, open_image
from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy

MAX_LISTED = 20


class DatasetImageError(ValueError):
    """One or more samples of the training data have unusable images."""


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


def _problems(dataset: Any, policy: ResizePolicy) -> Iterator[str]:
    images = dataset["_images"]
    prompts = dataset["_prompt"] if "_prompt" in dataset.column_names else [None] * len(images)
    jobs = [(index, source) for index, sources in enumerate(images) for source in sources or []]

    def run(job: tuple[int, Any]) -> str | None:
        index, source = job
        try:
            check_image(source, policy)
        except ImageError as exc:
            return f"sample {index} ({_prompt_excerpt(prompts[index])!r}): {exc}"
        return None

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for problem in pool.map(run, jobs, chunksize=64):
            if problem is not None:
                yield problem


def check_dataset_images(dataset: Any, policy: ResizePolicy) -> None:
    """Raise DatasetImageError listing the bad samples; streaming datasets are skipped (no random access)."""
    column_names = getattr(dataset, "column_names", None) or []
    if "_images" not in column_names or not hasattr(dataset, "__len__"):
        return
    problems = list(_problems(dataset, policy))
    if problems:
        listed = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise DatasetImageError(
            f"{len(problems)} image problem(s) in the training data (sample = 0-based index in the merged "
            f"dataset):\n  {listed}{more}\nFix or drop these samples (`qwenvl-prep check` lists them too)."
        )


def check_dataset_records(dataset: Any, template: Any, tokenizer: Any, data_args: Any, policy: ResizePolicy) -> None:
    """Raise DatasetRecordError listing records with misplaced or miscounted media placeholders, or whose image
    tokens ``cutoff_len`` would cut (``preflight_records``); streaming datasets are skipped."""
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
                in record_problems(dataset, template, tokenizer, data_args, policy, tags, utils.infer_seqlen)]
    if problems:
        listed = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise DatasetRecordError(
            f"{len(problems)} record problem(s) in the training data (sample = 0-based index in the merged "
            f"dataset):\n  {listed}{more}\nFix or drop these samples (`qwenvl-prep check` lists them too).")
