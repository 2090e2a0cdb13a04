"""Streaming readers: every input format becomes canonical records ``{"messages": [...], "images": [...]}``, with
``"videos"`` (paths, or frame lists: lists of image paths) when the record has any."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

from llamafactory_qwenvl_patch.scoring import json_text
from qwenvl_prep.formats.json_array import ArraySyntaxError, iter_array_items, iter_object_members, top_level_keys
from qwenvl_prep.lf.dataset_rules import not_carried

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
            "observation": "observation", "function_call": "function_call"}


class RecordError(ValueError):
    """A record whose structure cannot be understood (message says what is missing)."""


_BOM = b"\xef\xbb\xbf"


def iter_raw(path: Path) -> Iterator[Any]:
    """The text of each record, streamed and unparsed (workers parse it, as written): JSONL lines, or the items of a
    top-level JSON array. A UTF-8 byte-order mark is skipped; a record that is not UTF-8 is a RecordError (never
    silently replaced)."""
    with open(path, "rb") as f:
        start = 3 if f.read(3) == _BOM else 0
        f.seek(start)
        head = f.read(1)
        while head and head.isspace():
            head = f.read(1)
        f.seek(start)
        lines = _array_items(f, path) if head == b"[" else (line for line in f if line.strip())
        for line in lines:
            if isinstance(line, RecordError):
                yield line
                continue
            try:
                yield line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RecordError(f"record is not valid UTF-8 (byte {exc.start}: {line[exc.start:exc.start + 1]!r})")


def _array_items(f: Any, path: Path) -> Iterator[bytes | RecordError]:
    """The items of a top-level JSON array; broken punctuation ends the stream with one RecordError naming where."""
    try:
        yield from iter_array_items(f)
    except ArraySyntaxError as exc:
        yield RecordError(f"{path} is not a valid JSON array from here on ({exc}); the records before it are read")


def _value(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json_text.loads(raw)
    except json_text.JSONTextError as exc:
        return RecordError(f"record cannot be read as written: {exc}")
    except json.JSONDecodeError as exc:
        return RecordError(f"record is not valid JSON: {exc.msg} at column {exc.colno}")
    except ValueError as exc:
        return RecordError(f"record is not valid JSON: {exc}")


_CHARADES_LINE = re.compile(rb"\S+[ \t]+[-+.\deE]+[ \t]+[-+.\deE]+##")  # VID START END##sentence


def _first_line(path: Path) -> bytes:
    """The file's first line that is not blank (its first 64 KiB at most), byte-order mark skipped."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    head = head[3:] if head.startswith(_BOM) else head
    return next((line.strip() for line in head.splitlines() if line.strip()), b"")


def _first_member(f: Any) -> Any:
    """The value of the first member of the JSON object ``f`` holds, parsed; None when it holds no object."""
    try:
        _, raw = next(iter_object_members(f))
        return json.loads(raw)
    except (StopIteration, ValueError):
        return None


def detect_format(path: Path) -> str:
    """Guess the format from the first record (COCO from its top-level keys, ActivityNet Captions from its first
    video, Charades-STA from its first line, parquet from its suffix)."""
    if path.suffix == ".parquet":
        return "refcoco-parquet"
    if _CHARADES_LINE.match(_first_line(path)):
        return "charades-sta"
    if path.suffix != ".jsonl":
        with open(path, "rb") as f:
            if f.read(3) != _BOM:
                f.seek(0)
            start = f.tell()
            first = _first_member(f)
            if isinstance(first, dict) and {"timestamps", "sentences"} <= set(first):
                return "activitynet-captions"
            f.seek(start)
            keys: set[str] = set()
            for key in top_level_keys(f):  # COCO's own order puts a long 'images' list before 'annotations'
                keys.add(key)
                if "images" in keys and keys & {"annotations", "categories"}:
                    return "coco"
    for value in itertools.islice(map(_value, iter_raw(path)), 20):
        if isinstance(value, RecordError):
            continue  # a bad first line is its own error row; the format comes from the next good one
        if isinstance(value, dict):
            if {"vid", "query"} <= set(value) and {"relevant_windows", "qid"} & set(value):
                return "qvhighlights"
            if "video" in value and not {"messages", "conversations", "instruction"} & set(value):
                if "track" in value:
                    return "video-track"
                if {"timestamp", "timestamps", "span"} & set(value):
                    return "video-span"
            if "img_filename" in value and "bbox" in value:
                return "screenspot-pro" if "img_size" in value or "ui_type" in value else "screenspot"
            if "messages" in value or "conversations" in value:
                return "sharegpt"
            if "instruction" in value or "output" in value:
                return "alpaca"
            if "question" in value or "answer" in value or "image_path" in value:
                return "jsonl"
        break
    raise RecordError(f"{path}: cannot tell the format from its first records (empty, or none of sharegpt, alpaca, "
                      "plain JSONL, COCO, ScreenSpot, video-span, video-track, Charades-STA, ActivityNet Captions or "
                      "QVHighlights); pass --format")


def _type(value: Any) -> str:
    """A JSON value's Python type name (a number read as written counts as int or float)."""
    return type(json_text.plain(value)).__name__


def _sharegpt(record: dict) -> dict:
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise RecordError("record has no 'messages' or 'conversations' list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RecordError("a turn is not an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in ROLE_MAP or not isinstance(content, str):
            raise RecordError(f"turn with role {role!r} and content of type {_type(content)} is not usable")
        messages.append({"role": ROLE_MAP[role], "content": content})
    if record.get("system") is not None:  # a system column: a system turn, as LF reads it
        if messages[0]["role"] == "system":
            raise RecordError("the record has a 'system' field and a system turn; LLaMA-Factory would use only the "
                              "turn")
        messages.insert(0, {"role": "system", "content": _system(record)})
    return {"messages": messages, "images": _images(record), **_videos(record), **_tools(record)}


def _system(record: dict) -> str:
    if not isinstance(record["system"], str):
        raise RecordError(f"'system' must be text, got {_type(record['system'])}")
    return record["system"]


def _tools(record: dict) -> dict:
    """The record's tool definitions (agent data), carried as LF reads them: JSON text."""
    tools = record.get("tools")
    if tools is None or tools == "":
        return {}
    if isinstance(tools, (list, dict)):
        tools = json_text.dumps(tools, separators=(", ", ": "))
    if not isinstance(tools, str):
        raise RecordError(f"'tools' must be JSON text or a JSON array, got {_type(tools)}")
    return {"tools": tools}


def _images(record: dict) -> list[str]:
    images = record.get("images", record.get("image", record.get("image_path", [])))
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise RecordError("'images' must be a list of paths")
    return images


def _videos(record: dict) -> dict:
    """The record's ``videos`` (LF's column): video paths, or frame lists (lists of image paths); {} when none."""
    videos = record.get("videos")
    if videos is None or videos == []:
        return {}
    if isinstance(videos, str):
        videos = [videos]
    if not isinstance(videos, list) or not all(
            isinstance(v, str) or (isinstance(v, list) and all(isinstance(p, str) for p in v)) for v in videos):
        raise RecordError("'videos' must be a list of video paths, or of frame lists (lists of image paths)")
    if len({isinstance(v, list) for v in videos}) > 1:
        raise RecordError("'videos' mixes video files and frame lists; LLaMA-Factory reads one kind per dataset")
    return {"videos": videos}


def _with_image_tags(messages: list[dict], count: int, tag: str = "<image>") -> list[dict]:
    """The conversation with the tags it lacks (one per image, or per video with ``tag="<video>"``, counted over
    every user turn) put before the last question, where a plain or alpaca record's media belong. Extra or
    misplaced tags are left for ``dataset_rules.record_problem`` to report."""
    missing = count - sum(m["content"].count(tag) for m in messages if m["role"] == "user")
    if missing > 0:
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last]["content"] = tag * missing + messages[last]["content"]
    return messages


def _alpaca(record: dict) -> dict:
    if not isinstance(record.get("instruction"), str) or not isinstance(record.get("output"), str):
        raise RecordError("alpaca record needs string 'instruction' and 'output'")
    images = _images(record)
    prompt = record["instruction"] + (("\n" + record["input"]) if record.get("input") else "")
    messages = [{"role": "system", "content": _system(record)}] if record.get("system") is not None else []
    history = record.get("history") or []
    if not isinstance(history, list) or not all(
            isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) for t in turn) for turn in history):
        raise RecordError("alpaca 'history' must be a list of [prompt, answer] string pairs")
    for old_prompt, old_answer in history:
        messages += [{"role": "user", "content": old_prompt}, {"role": "assistant", "content": old_answer}]
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    videos = _videos(record)
    messages = _with_image_tags(messages, len(videos.get("videos", [])), "<video>")
    return {"messages": _with_image_tags(messages, len(images)), "images": images, **videos, **_tools(record)}


def _answer_text(answer: Any) -> str:
    """A string answer as is; a JSON object or array (field extraction) as compact JSON text, keys in order."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (dict, list)):
        try:
            return json_text.dumps(answer)
        except ValueError:
            raise RecordError("'answer' contains NaN or Infinity, which is not JSON") from None
    raise RecordError(f"'answer' must be text or a JSON object/array, got {_type(answer)}")


def _plain(record: dict) -> dict:
    """``{"image" | "images" | "image_path": ..., "question": str, "answer": str | object | array, "meta": ...}``."""
    if not isinstance(record.get("question"), str) or "answer" not in record:
        raise RecordError("record needs 'image' (or 'image_path'), a string 'question' and an 'answer'")
    images = _images(record)
    if not images:
        raise RecordError("record needs an 'image' or 'image_path'")
    messages = [{"role": "user", "content": record["question"]},
                {"role": "assistant", "content": _answer_text(record["answer"])}]
    return {"messages": _with_image_tags(messages, len(images)), "images": images}


def meta_text(meta: Any) -> str:
    """``meta`` as JSON text: LF ignores the column, and a text column loads whatever each record's ``meta`` holds
    (an object column whose types differ between records stops ``datasets`` from loading the file)."""
    if isinstance(meta, str):
        return meta
    try:
        return json_text.dumps(meta, separators=(", ", ": "))
    except (TypeError, ValueError):
        raise RecordError("'meta' is not JSON-serialisable") from None


_NORMALIZE = {"sharegpt": _sharegpt, "alpaca": _alpaca, "jsonl": _plain}


def to_record(raw: Any, fmt: str, remap: Callable[[dict], dict] | None = None) -> dict | RecordError:
    """A canonical record from one raw input value; a malformed one becomes its RecordError. ``remap`` renames a
    raw record's keys first (``dataset_rules.entry_reader``: a dataset read as its registry entry tells LF to)."""
    if isinstance(raw, RecordError):
        return raw
    value = _value(raw)
    if isinstance(value, RecordError):
        return value
    if not isinstance(value, dict):
        return RecordError(f"record is a {_type(value)}, not an object")
    if fmt == "canonical":
        if value.get("meta") is not None:
            value["meta"] = meta_text(value["meta"])
        return value
    try:
        if remap is not None:
            value = {**remap(value), **({"meta": value["meta"]} if "meta" in value else {})}
        elif (lost := not_carried(value)) is not None:
            raise RecordError(lost)
        record = _NORMALIZE[fmt](value)
        if value.get("meta") is not None:
            record["meta"] = meta_text(value["meta"])
        return record
    except RecordError as exc:
        return exc


def iter_records(path: Path, fmt: str, remap: Callable[[dict], dict] | None = None) -> Iterator[dict | RecordError]:
    """Canonical records in file order (a malformed one is yielded as its RecordError, keeping its index)."""
    return (to_record(raw, fmt, remap) for raw in iter_raw(path))
