"""Up-front image check of a pinned training run: every bad image is reported at once, by sample and file.

Runs before LLaMA-Factory's tokenization workers, where a bad file would otherwise surface as a PIL stack trace
from a ``datasets.map`` worker, one file per attempt.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from PIL import Image

from llamafactory_qwenvl_patch.images import ImageError, describe, open_image
from llamafactory_qwenvl_patch.policy import PolicyError, ResizePolicy

MAX_LISTED = 20


class DatasetImageError(ValueError):
    """One or more samples of the training data have unusable images."""


JPEG_EOI = b"\xff\xd9"
TAIL_BYTES = 4096


def _jpeg_tail_complete(source: Any) -> bool:
    """True when the JPEG's last bytes hold the end-of-image marker (a truncated download never has it)."""
    try:
        if isinstance(source, dict):
            source = source.get("bytes") or source.get("path")
        if isinstance(source, bytes):
            return JPEG_EOI in source[-TAIL_BYTES:]
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                f.seek(max(0, os.path.getsize(source) - TAIL_BYTES))
                return JPEG_EOI in f.read()
    except OSError:
        return False
    return False


def check_image(source: Any, policy: ResizePolicy) -> None:
    """Raise ImageError if the image is missing, unreadable, truncated or outside the policy's aspect limit.

    Cheap by default (header, size, the JPEG end marker), since it runs at every training start. A JPEG without
    its end marker is decoded at 1/8 scale (``draft`` still reads all entropy-coded data) to tell a truncated file
    from one with a trailer; other formats are verified (PNG: every chunk CRC).
    """
    name = describe(source)
    image = open_image(source)
    try:
        policy.model_size(image.height, image.width)
    except PolicyError as exc:
        raise ImageError(f"image {name}: {exc}") from None
    try:
        if image.format == "JPEG":
            if _jpeg_tail_complete(source):
                return
            image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
            image.load()
        elif isinstance(source, Image.Image):
            image.load()
        else:
            image.verify()
    except (OSError, SyntaxError, ValueError) as exc:
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
