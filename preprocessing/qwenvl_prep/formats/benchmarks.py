"""Readers for public grounding benchmarks -> canonical records, with the truth box and the subset fields in
``meta`` for the click rewards and ``qwenvl-prep eval --by``.

- ScreenSpot / ScreenSpot-v2 (SeeClick, OS-Atlas): a JSON list of ``{"img_filename", "bbox": [left, top, width,
  height], "instruction", "data_type": "text" | "icon", "data_source"}``, in original pixels.
- ScreenSpot-Pro: ``{"img_filename", "bbox": [x1, y1, x2, y2], "img_size": [width, height], "instruction",
  "ui_type", "group", "application", "platform", "id", ...}``.
- RefCOCO / RefCOCO+ / RefCOCOg in lmms-eval's parquet layout: ``{"question_id", "image": {"bytes", "path"},
  "answer": [referring expressions], "bbox": [x, y, width, height], "file_name", ...}``; the image bytes are written
  once each (named by their hash) beside the output, because LLaMA-Factory reads images from paths. A run that
  writes no output (refused, stopped) removes the images it added (``ImageStore``).

Coordinates stay in original pixels here; convert maps the answer into the model's frame like any other format.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import threading
from pathlib import Path
from typing import Any, Iterator

from llamafactory_qwenvl_patch.scoring.clicks import TRUTH_BOX_KEY
from qwenvl_prep.plumbing.atomic import atomic_writer
from qwenvl_prep.formats.records import RecordError, iter_raw
from qwenvl_prep.lf.dataset_rules import special_token_problem

TARGETS = ("point", "box")
PROMPTS = {
    "point": 'Click the element for "{instruction}" and output its point_2d coordinates in JSON format.',
    "box": 'Locate "{instruction}" and output its bbox_2d coordinates in JSON format.',
}
DEFAULT_TARGET = {"screenspot": "point", "screenspot-pro": "point", "refcoco-parquet": "box"}
INSTRUCTION_KEY = "instruction"  # meta: the record's instruction (ScreenSpot) or referring expression (RefCOCO)
FORMAT_KEY = "source_format"  # meta: the benchmark format it was converted from
_TEXT_KEYS = ("img_filename", "bbox", "instruction", "img_size")  # carried elsewhere, not copied into meta


MAX_PIXEL_COORD = 1e6  # original pixels: no screenshot is a million pixels on a side (1e308 overflowed x + w)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _corners(bbox: Any, layout: str) -> list[float]:
    """[x1, y1, x2, y2] from ``bbox`` in ``layout`` (``xywh`` or ``xyxy``); RecordError when it is not 4 numbers
    with a positive extent."""
    if not (isinstance(bbox, list) and len(bbox) == 4 and all(map(_number, bbox))):
        raise RecordError(f"'bbox' {bbox!r} is not 4 numbers")
    if max(abs(v) for v in bbox) > MAX_PIXEL_COORD:
        raise RecordError(f"'bbox' {bbox!r} has a value beyond {MAX_PIXEL_COORD:g} px, larger than any screenshot")
    x1, y1, a, b = bbox
    x2, y2 = (x1 + a, y1 + b) if layout == "xywh" else (a, b)
    if x2 <= x1 or y2 <= y1:
        raise RecordError(f"'bbox' {bbox!r} ({layout}) has no area")
    return [x1, y1, x2, y2]


def _answer(box: list[float], target: str) -> str:
    if target == "box":
        return json.dumps([{"bbox_2d": box}])
    return json.dumps([{"point_2d": [(box[0] + box[2]) / 2, (box[1] + box[3]) / 2]}])


MEDIA_TAGS = ("<image>", "<video>", "<audio>")


def check_prompt(prompt: str) -> None:
    """A prompt template must place the instruction once and carry no media tag (convert adds the one image tag)."""
    if prompt.count("{instruction}") != 1:
        raise ValueError(f"--prompt {prompt!r} must contain {{instruction}} exactly once: it is where each "
                         "record's instruction goes")
    if any(tag in prompt for tag in MEDIA_TAGS):
        raise ValueError(f"--prompt {prompt!r} contains a media tag; convert adds the image's <image> tag itself")
    if (problem := special_token_problem(prompt)) is not None:
        raise ValueError(f"--prompt {prompt!r} holds {problem}")


def _record(image: str, instruction: Any, box: list[float], target: str, prompt: str, meta: dict, fmt: str
            ) -> dict:
    """One record; ``meta`` keeps the instruction and the format it came from, so that predict --prompt-preset can
    ask it again in a benchmark's own words."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise RecordError(f"'instruction' must be non-empty text, got {instruction!r}")
    tag = next((tag for tag in MEDIA_TAGS if tag in instruction), None)
    if tag:
        raise RecordError(f"'instruction' {instruction[:80]!r} contains {tag}, which LLaMA-Factory would read as a "
                          "second media item")
    return {"messages": [{"role": "user", "content": "<image>" + prompt.replace("{instruction}", instruction)},
                         {"role": "assistant", "content": _answer(box, target)}],
            "images": [image],  # ours win over an entry's own keys of these names
            "meta": {**meta, INSTRUCTION_KEY: instruction, FORMAT_KEY: fmt, TRUTH_BOX_KEY: box}}


def _scalars(entry: dict) -> dict:
    """The annotation's subset fields (platform, data_type, ui_type, group, application, id, ...): every scalar
    value except those the record carries elsewhere."""
    return {key: value for key, value in entry.items()
            if key not in _TEXT_KEYS and (isinstance(value, (str, bool)) or _number(value))}


def iter_screenspot(path: Path, fmt: str, target: str, prompt: str) -> Iterator[dict | RecordError]:
    """ScreenSpot (``bbox`` as left, top, width, height) or ScreenSpot-Pro (``bbox`` as corners, ``img_size``
    checked against the file by convert)."""
    layout = "xyxy" if fmt == "screenspot-pro" else "xywh"
    for raw in iter_raw(path):
        try:
            entry = json.loads(raw) if isinstance(raw, str) else raw
            if isinstance(entry, RecordError):
                raise entry
            if not isinstance(entry, dict) or not isinstance(entry.get("img_filename"), str):
                raise RecordError("a ScreenSpot entry is an object with a string 'img_filename'")
            record = _record(entry["img_filename"], entry.get("instruction"), _corners(entry.get("bbox"), layout),
                             target, prompt, _scalars(entry), fmt)
            size = entry.get("img_size")
            if isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) for v in size):
                record["declared_size"] = size
            yield record
        except RecordError as error:
            yield error
        except ValueError as error:
            yield RecordError(f"entry is not valid JSON ({error})")


class ImageStore:
    """The folder of images a parquet's rows carry, written once each (named by their hash). Remembers the files
    this run added, so that a run that writes no output (refused, stopped by a signal) removes them with ``discard``
    and leaves the folder as it found it. Thread-safe: a pool's feeder thread writes while the main thread may
    discard; nothing is written after a discard."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._added: list[Path] = []
        self._made_folder = False
        self._closed = False
        self._lock = threading.Lock()

    def write(self, data: Any) -> str:
        """Write an image's bytes unless an identical file is there; returns the path."""
        if not isinstance(data, (bytes, bytearray)) or not data:
            raise RecordError("'image' has no bytes")
        from PIL import Image, UnidentifiedImageError

        try:
            kind = (Image.open(io.BytesIO(data)).format or "").lower()
        except Image.DecompressionBombError as error:
            raise RecordError(f"'image' is refused as a decompression bomb ({error})") from None
        except (UnidentifiedImageError, OSError) as error:
            raise RecordError(f"'image' bytes are not a readable image ({error})") from None
        suffix = {"jpeg": ".jpg", "png": ".png", "webp": ".webp", "bmp": ".bmp", "gif": ".gif"}.get(kind)
        if suffix is None:
            raise RecordError(f"'image' is a {kind or 'unknown'} file; expected JPEG, PNG, WebP, BMP or GIF")
        path = self.folder / (hashlib.sha256(data).hexdigest()[:24] + suffix)
        with self._lock:
            if self._closed:
                raise RecordError("the run was stopped before this row's image was written")
            if not path.is_file() or path.stat().st_size != len(data):
                # recorded before each step, so that a signal between two of them leaves nothing discard misses
                if not self.folder.is_dir():
                    self._made_folder = True
                    self.folder.mkdir(parents=True)
                if not path.exists():
                    self._added.append(path)
                with atomic_writer(path, "wb") as out:
                    out.write(data)
        return str(path)

    def discard(self) -> None:
        """Remove what this run added (the folder too, if the run made it: with the temp files a writer stopped
        right after making one left in it); write nothing after."""
        with self._lock:
            self._closed = True
            for path in self._added:
                path.unlink(missing_ok=True)
            self._added.clear()
            if self._made_folder and self.folder.is_dir():
                for stale in self.folder.glob(".*.tmp"):
                    stale.unlink(missing_ok=True)
                if not any(self.folder.iterdir()):
                    self.folder.rmdir()


REFCOCO_COLUMNS = ("image", "answer", "bbox")


def iter_refcoco_parquet(path: Path, target: str, prompt: str, images: ImageStore, expressions: str = "all"
                         ) -> Iterator[dict | RecordError]:
    """One record per referring expression (``expressions="all"``, every RefCOCO test sample) or per row
    (``"first"``); streamed in batches so that memory holds a few dozen images, not the file."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise RecordError(f"{path} is not a readable parquet file ({error})") from None
    missing = [c for c in REFCOCO_COLUMNS if c not in table.schema_arrow.names]
    if missing:
        raise RecordError(f"{path}: a RefCOCO parquet file needs the columns {', '.join(REFCOCO_COLUMNS)}; "
                          f"missing {', '.join(missing)}")
    for row in _rows(table, path):
        if isinstance(row, RecordError):
            yield row
            return
        try:
            box = _corners(row["bbox"], "xywh")
            answers = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
            meta = _scalars({k: v for k, v in row.items() if k not in ("image", "answer", "segmentation")})
            image = row["image"]
            image = images.write(image.get("bytes") if isinstance(image, dict) else image)  # the row judged first
            for expression in answers[:1] if expressions == "first" else answers:
                yield _record(image, expression, box, target, prompt, meta, "refcoco-parquet")
        except RecordError as error:
            yield error

def _rows(table: Any, path: Path) -> Iterator[dict | RecordError]:
    """The file's rows, streamed; a file damaged past its header ends the stream with one RecordError naming it."""
    try:
        for batch in table.iter_batches(batch_size=32):
            yield from batch.to_pylist()
    except Exception as error:  # noqa: BLE001 - pyarrow raises several types for damaged data
        yield RecordError(f"{path} cannot be read from here on ({type(error).__name__}: {error}); the rows before "
                          "it are read")
