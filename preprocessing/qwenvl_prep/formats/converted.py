"""Reading a converted (stamped) LF dataset back: records, their images and videos, and their items in the stamp's
convention."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from llamafactory_qwenvl_patch.scoring.answers import AnswerError, Item, parse_items
from llamafactory_qwenvl_patch.frame.stamp import Stamp, StampError, read_dataset_info, stamp_of
from qwenvl_prep.lf.dataset_rules import entry_reader, record_problem
from qwenvl_prep.formats.records import RecordError, iter_records
from qwenvl_prep.plumbing.outputs import Outputs, UnsafeOutput


@dataclass(frozen=True)
class DatasetRef:
    """One dataset: its file, the folder LF resolves images against, and its stamp (None if unstamped)."""

    name: str
    path: Path
    media_dir: Path
    stamp: Stamp | None
    entry: dict | None = None  # its dataset_info.json entry: records are read as LF reads them under it


@dataclass
class Sample:
    index: int
    images: list[str]
    prompt: str
    answer: str
    items: list[Item]  # the answer's (assistant turns): what eval and draw take as the truth
    error: str | None = None
    meta: Any = None  # the record's ``meta``, parsed when it is JSON text
    turn_items: list[Item] = field(default_factory=list)  # every turn's, system and tool turns included (check)
    videos: list[Any] = field(default_factory=list)  # paths, or frame lists (lists of paths), resolved as LF does
    turns: list[str] = field(default_factory=list)  # every turn's text (check reads time labels from them)
    system: str | None = None  # the record's system prompt (its system turn or column), as LF's template writes it


def resolve_dataset(name_or_path: str, dataset_dir: str | Path | None = None) -> DatasetRef:
    """A dataset_info.json name in ``dataset_dir``, or a file path (stamp looked up beside it). A name the registry
    holds is its entry even where a file of that name lies in the working directory: LF reads the entry."""
    path = Path(name_or_path)
    if path.is_file() and not _registered(name_or_path, dataset_dir):
        folder = path.parent
        for name, entry in read_dataset_info(folder).items():
            if isinstance(entry, dict) and entry.get("file_name") == path.name:
                return DatasetRef(name, path, folder, _stamp(entry, name, folder), entry)
        return DatasetRef(path.stem, path, folder, None)
    folder = Path(dataset_dir or ".")
    entry = read_dataset_info(folder).get(name_or_path)
    if not isinstance(entry, dict) or "file_name" not in entry:
        raise ValueError(f"dataset {name_or_path!r} is neither a file nor an entry of {folder}/dataset_info.json")
    path = folder / str(entry["file_name"])
    if not path.is_file():
        what = "a folder" if path.is_dir() else "not found"
        raise ValueError(f"dataset {name_or_path!r} in {folder}/dataset_info.json names file_name "
                         f"{entry['file_name']!r}, which is {what}: qwenvl-prep reads a dataset stored in one file")
    return DatasetRef(name_or_path, path, folder, _stamp(entry, name_or_path, folder), entry)


def _registered(name: str, dataset_dir: str | Path | None) -> bool:
    try:
        return isinstance(read_dataset_info(Path(dataset_dir or ".")).get(name), dict)
    except (OSError, ValueError):  # an unreadable registry: the file is what was meant
        return False


def _stamp(entry: dict, name: str, folder: Path) -> Stamp | None:
    try:
        return stamp_of(entry)
    except StampError as exc:
        raise StampError(f"dataset {name!r} in {folder / 'dataset_info.json'}: {exc}") from None


def iter_samples(ref: DatasetRef) -> Iterator[Sample]:
    """The records as LF reads them (under the registry entry when there is one; EntryError when check cannot read
    that entry's layout); a record LF would drop or refuse is a Sample with its error."""
    fmt, remap = entry_reader(ref.entry) if ref.entry is not None else ("sharegpt", None)
    for index, record in enumerate(iter_records(ref.path, fmt, remap)):
        if not isinstance(record, RecordError) and (problem := record_problem(record)) is not None:
            record = RecordError(problem)
        if isinstance(record, RecordError):
            yield Sample(index, [], "", "", [], error=str(record))
            continue
        images = [_media_path(ref, p) for p in record["images"]]
        videos = [[_media_path(ref, f) for f in v] if isinstance(v, list) else _media_path(ref, v)
                  for v in record.get("videos") or []]
        messages = record["messages"]
        prompt = " ".join(m["content"] for m in messages if m["role"] == "user")
        answer = "\n".join(m["content"] for m in messages if m["role"] == "assistant")
        try:
            parsed = [(m["role"], parse_items(m["content"])) for m in messages]
        except AnswerError as exc:
            yield Sample(index, images, prompt, answer, [], str(exc), _meta(record.get("meta")), videos=videos)
            continue
        yield Sample(index, images, prompt, answer, [i for role, items in parsed if role == "assistant" for i in items],
                     meta=_meta(record.get("meta")), turn_items=[i for _, items in parsed for i in items],
                     videos=videos, turns=[m["content"] for m in messages],
                     system=messages[0]["content"] if messages and messages[0]["role"] == "system" else None)


def _media_path(ref: DatasetRef, path: str) -> str:
    return path if Path(path).is_absolute() else str(ref.media_dir / path)


def _meta(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def iter_jsonl(path: str | Path) -> Iterator[Any]:
    """The values of a JSONL file, streamed; a bad line is a ValueError naming the file and the line. A UTF-8
    byte-order mark is skipped, as convert skips it."""
    if not Path(path).is_file():
        raise ValueError(f"{path} is {'a folder' if Path(path).is_dir() else 'not found'}, not a JSONL file")
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if not line.strip():
                continue
            try:
                yield json.loads(line.decode("utf-8"))
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
                raise ValueError(f"{path} line {number} is not valid JSON ({exc})") from None


def load_jsonl(path: str | Path) -> list[dict]:
    return list(iter_jsonl(path))


def guard_dataset_outputs(ref: DatasetRef, inputs: list[str | os.PathLike],
                          outputs: dict[str, str | os.PathLike | None]) -> None:
    """Check the outputs (flag -> path, None when not given) of a command that reads a dataset (``DatasetRef``),
    its images and ``inputs``; the images are streamed from the dataset, so memory stays flat."""
    given = {flag: path for flag, path in outputs.items() if path is not None}
    if not given:
        return
    guard = Outputs([ref.path, *inputs], [ref.media_dir])
    for flag, path in given.items():
        guard.check(path, flag)
    targets = {Path(path).resolve(): flag for flag, path in given.items()}
    for sample in iter_samples(ref):
        for image in sample.images:
            flag = targets.get(Path(image).resolve())
            if flag is not None:
                raise UnsafeOutput(f"{flag} {given[flag]} is an image of dataset record {sample.index}; inputs are "
                                   "never overwritten")
