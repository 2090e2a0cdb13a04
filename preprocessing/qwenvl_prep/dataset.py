"""Reading a converted (stamped) LF dataset back: records, their image and their items in the stamp's convention."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from llamafactory_qwenvl_patch.scoring.answers import AnswerError, Item, parse_items
from llamafactory_qwenvl_patch.frame.stamp import Stamp, read_dataset_info, stamp_of
from qwenvl_prep.readers import RecordError, iter_records


@dataclass(frozen=True)
class DatasetRef:
    """One dataset: its file, the folder LF resolves images against, and its stamp (None if unstamped)."""

    name: str
    path: Path
    media_dir: Path
    stamp: Stamp | None


@dataclass
class Sample:
    index: int
    images: list[str]
    prompt: str
    answer: str
    items: list[Item]
    error: str | None = None
    meta: Any = None  # the record's ``meta``, parsed when it is JSON text


def resolve_dataset(name_or_path: str, dataset_dir: str | Path | None = None) -> DatasetRef:
    """A dataset_info.json name in ``dataset_dir``, or a file path (stamp looked up beside it)."""
    path = Path(name_or_path)
    if path.is_file():
        folder = path.parent
        for name, entry in read_dataset_info(folder).items():
            if isinstance(entry, dict) and entry.get("file_name") == path.name:
                return DatasetRef(name, path, folder, stamp_of(entry))
        return DatasetRef(path.stem, path, folder, None)
    folder = Path(dataset_dir or ".")
    entry = read_dataset_info(folder).get(name_or_path)
    if not isinstance(entry, dict) or "file_name" not in entry:
        raise ValueError(f"dataset {name_or_path!r} is neither a file nor an entry of {folder}/dataset_info.json")
    return DatasetRef(name_or_path, folder / entry["file_name"], folder, stamp_of(entry))


def iter_samples(ref: DatasetRef) -> Iterator[Sample]:
    for index, record in enumerate(iter_records(ref.path, "sharegpt")):
        if isinstance(record, RecordError):
            yield Sample(index, [], "", "", [], error=str(record))
            continue
        images = [p if Path(p).is_absolute() else str(ref.media_dir / p) for p in record["images"]]
        prompt = " ".join(m["content"] for m in record["messages"] if m["role"] == "user")
        answer = "\n".join(m["content"] for m in record["messages"] if m["role"] == "assistant")
        try:
            items = parse_items(answer)
            error = None
        except AnswerError as exc:
            items, error = [], str(exc)
        yield Sample(index, images, prompt, answer, items, error, _meta(record.get("meta")))


def _meta(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def iter_jsonl(path: str | Path) -> Iterator[Any]:
    """The values of a JSONL file, streamed; a bad line is a ValueError naming the file and the line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path} line {number} is not valid JSON ({exc})") from None


def load_jsonl(path: str | Path) -> list[dict]:
    return list(iter_jsonl(path))
