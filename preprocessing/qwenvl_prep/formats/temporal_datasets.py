"""The temporal grounding datasets as their authors distribute them -> canonical span records (``--format
charades-sta | activitynet-captions | qvhighlights``), each video id found as a clip in the video folder.

- Charades-STA, ``charades_sta_{train,test}.txt``: one moment per line, ``VID START END##sentence``
  (``3MSZA 24.3 30.4##person turn a light on.``); clips ``VID.mp4``.
- ActivityNet Captions, ``train.json`` / ``val_1.json`` / ``val_2.json``: one JSON object keyed by video id
  (``v_QOlSCBRmfWY``), each ``{"duration", "timestamps": [[s, e], ...], "sentences": [...]}``, read member by member;
  one record per (video, sentence); clips ``ID.mp4``, ``.mkv`` or ``.webm``, the id with its ``v_`` or without.
- QVHighlights, ``highlight_{train,val}_release.jsonl``: one query per line, ``{"qid", "query", "duration", "vid",
  "relevant_windows": [[s, e], ...], ...}``; every window is kept, in the file's order: the answer is the list
  ``[{"span": [s, e]}, ...]``, which the tIoU reward matches one to one with the model's; clips ``VID.mp4``.

Times reach the answer as the file writes them (``24.30`` stays ``24.30``). Structure is checked here (two numbers,
``0 <= start < end``); whether each span lies in the clip, and a declared ``duration`` is the clip's, convert checks
once the clip is probed, as for ``video-span``. These files are known to end spans past their videos (Charades-STA's
times come from Charades' action annotations, ActivityNet's from annotators' clocks): their records carry
``CLAMP_KEY``, and convert sets an end past the clip's to the clip's end, as the datasets' maintainers and Lighthouse
do, and notes it in ``meta``. Each record carries where it comes from (``line 12``, ``entry 3,
sentence 1``), which its error rows name.
"""

from __future__ import annotations

import codecs
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

from llamafactory_qwenvl_patch.scoring import json_text
from llamafactory_qwenvl_patch.scoring.json_text import Number
from qwenvl_prep.formats.benchmarks import FORMAT_KEY
from qwenvl_prep.formats.json_array import ArraySyntaxError, iter_object_members
from qwenvl_prep.formats.records import RecordError, meta_text
from qwenvl_prep.formats.temporal import ORIGIN_KEY, PROMPTS as SPAN_PROMPTS, QUERY_KEY, query_text, video_record

FORMATS = ("charades-sta", "activitynet-captions", "qvhighlights")
PROMPTS = {
    "charades-sta": SPAN_PROMPTS["video-span"],
    "activitynet-captions": SPAN_PROMPTS["video-span"],
    "qvhighlights": 'When does "{query}" happen in the video? Output every moment it happens, each with its start and '
                    'end in seconds, as a JSON list: [{"span": [start, end]}, ...].',
}
CLAMP_KEY = "clamp_span_ends"  # a record key (not written): span ends past the clip are set to its end
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class ClipNames:
    """The file names a dataset's clip may have, in the order they are tried: the id as written, then (with
    ``prefix``) without it, or with it when the id is written without; each with every extension in turn."""

    extensions: tuple[str, ...]
    prefix: str = ""

    def candidates(self, video_id: str) -> list[str]:
        forms = [video_id]
        if self.prefix:
            forms.append(video_id[len(self.prefix):] if video_id.startswith(self.prefix) else self.prefix + video_id)
        return [form + extension for form in forms for extension in self.extensions]


CLIP_NAMES = {
    "charades-sta": ClipNames((".mp4",)),
    "activitynet-captions": ClipNames((".mp4", ".mkv", ".webm"), "v_"),
    "qvhighlights": ClipNames((".mp4",)),
}


class ClipFolder:
    """The clips of one folder, listed once: a dataset asks for tens of thousands of ids, several queries each."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._names: set[str] | None = None

    def find(self, video_id: str, names: ClipNames) -> str:
        """The file name of ``video_id``'s clip in the folder; RecordError naming the names tried."""
        if self._names is None:
            try:
                with os.scandir(self.folder) as entries:
                    self._names = {entry.name for entry in entries if entry.is_file()}
            except OSError as error:
                raise RecordError(f"the video folder {self.folder} cannot be read ({error.strerror})") from None
        tried = names.candidates(video_id)
        found = next((name for name in tried if name in self._names), None)
        if found is None:
            raise RecordError(f"no clip in {self.folder} (tried {', '.join(tried)}); give --video-dir, the folder "
                              "that holds the dataset's clips")
        return found


def _window(pair: Any) -> list[Number]:
    """A ``[start, end]`` window as written: two numbers, ``0 <= start < end``."""
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, Number) for v in pair)):
        raise RecordError(f"the window {json_text.plain(pair)!r} must be [start, end] in seconds")
    start, end = (v.value for v in pair)
    if start < 0 or end <= start:
        raise RecordError(f"the window [{pair[0]}, {pair[1]}] lies outside the clip (need 0 <= start < end, in "
                          "seconds)")
    return pair


def _nth_window(index: int, pair: Any) -> list[Number]:
    try:
        return _window(pair)
    except RecordError as error:
        raise RecordError(f"window {index}: {error}") from None


def _time(text: str, what: str) -> Number:
    if not _JSON_NUMBER.fullmatch(text):
        raise RecordError(f"the {what} time {text!r} is not a number of seconds as JSON writes one (e.g. 24.3)")
    return Number(text)


def _declared(value: Any) -> dict:
    """The record's declared duration (checked against the clip by convert); {} when the file gives none."""
    if value is None:
        return {}
    if not isinstance(value, Number) or not value.value > 0:
        raise RecordError(f"'duration' {json_text.plain(value)!r} must be a number of seconds > 0")
    return {"declared_duration": value.value}


def _record(clip: str, prompt: str, query: str, spans: list[list[Number]], meta: dict, declared: dict,
            origin: str, several: bool = False) -> dict:
    """One span record; ``several``: the answer lists every window (QVHighlights), else it is the one span."""
    answer = [{"span": span} for span in spans] if several else {"span": spans[0]}
    record = video_record(clip, prompt, query, json_text.dumps(answer, separators=(", ", ": ")), meta_text(meta),
                          declared)
    return {**record, ORIGIN_KEY: origin, CLAMP_KEY: True}


def _lines(path: Path) -> Iterator[tuple[int, str | RecordError]]:
    """(line number from 1, its text stripped) of each line that is not blank; a line that is not UTF-8 is a
    RecordError (never silently replaced)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            raw = raw[len(codecs.BOM_UTF8):] if number == 1 and raw.startswith(codecs.BOM_UTF8) else raw
            if not raw.strip():
                continue
            try:
                yield number, raw.decode("utf-8").strip()
            except UnicodeDecodeError as error:
                yield number, RecordError(f"not valid UTF-8 (byte {error.start})")


def _per_line(path: Path, read: Callable[[int, str, list[str]], dict]) -> Iterator[dict | RecordError]:
    """One record per line that is not blank, ``read(number, text, where)``: ``where`` starts as ``["line N"]`` and
    ``read`` adds what it learns (the video id), which an error row then names."""
    for number, line in _lines(path):
        where = [f"line {number}"]
        try:
            if isinstance(line, RecordError):
                raise line
            yield read(number, line, where)
        except RecordError as error:
            yield RecordError(f"{', '.join(where)}: {error}")


def _charades_line(folder: ClipFolder, prompt: str, number: int, line: str, where: list[str]) -> dict:
    head, separator, sentence = line.partition("##")
    fields = head.split()
    if not separator or len(fields) != 3:
        raise RecordError(f"expected 'VID START END##sentence', got {line[:80]!r}")
    video_id, start, end = fields
    where.append(f"video {video_id}")
    span = _window([_time(start, "start"), _time(end, "end")])
    query = query_text(sentence)
    clip = folder.find(video_id, CLIP_NAMES["charades-sta"])
    meta = {"vid": video_id, QUERY_KEY: query, "line": number, FORMAT_KEY: "charades-sta"}
    return _record(clip, prompt, query, [span], meta, {}, ", ".join(where))


def iter_charades(path: Path, folder: ClipFolder, prompt: str) -> Iterator[dict | RecordError]:
    """Charades-STA's lines, one record each."""
    return _per_line(path, partial(_charades_line, folder, prompt))


def _members(path: Path) -> Iterator[tuple[str, bytes] | RecordError]:
    """The top-level object's members; broken punctuation ends them with one RecordError naming where."""
    with open(path, "rb") as f:
        if f.read(len(codecs.BOM_UTF8)) != codecs.BOM_UTF8:
            f.seek(0)
        try:
            yield from iter_object_members(f)
        except ArraySyntaxError as error:
            yield RecordError(f"{path} is not a valid JSON object from here on ({error}); the videos before it are "
                              "read")


def _loads(raw: bytes | str) -> Any:
    try:
        return json_text.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except UnicodeDecodeError as error:
        raise RecordError(f"not valid UTF-8 (byte {error.start})") from None
    except ValueError as error:
        raise RecordError(f"not valid JSON ({error})") from None


def iter_activitynet(path: Path, folder: ClipFolder, prompt: str) -> Iterator[dict | RecordError]:
    """ActivityNet Captions' videos, one record per sentence: a problem with the video (its entry, its clip) is one
    error row for all its sentences, a problem with one sentence (its window) that sentence's row."""
    seen: dict[str, int] = {}
    for number, member in enumerate(_members(path), start=1):
        if isinstance(member, RecordError):
            yield member
            return
        video_id, raw = member
        where = f"entry {number}, video {video_id}"
        try:
            if video_id in seen:
                raise RecordError(f"the id appears again (first in entry {seen[video_id]}); a JSON reader would keep "
                                  "only one of them")
            seen[video_id] = number
            entry = _loads(raw)
            sentences = entry.get("sentences") if isinstance(entry, dict) else None
            timestamps = entry.get("timestamps") if isinstance(entry, dict) else None
            if not (isinstance(sentences, list) and isinstance(timestamps, list) and sentences
                    and len(sentences) == len(timestamps)):
                raise RecordError("needs 'sentences' and 'timestamps': two lists of the same length, one [start, "
                                  f"end] window per sentence, got {_length(sentences)} and {_length(timestamps)}")
            declared = _declared(entry.get("duration"))
            clip = folder.find(video_id, CLIP_NAMES["activitynet-captions"])
        except RecordError as error:
            yield RecordError(f"{where}: {error}")
            continue
        for index, (sentence, pair) in enumerate(zip(sentences, timestamps)):
            here = f"{where}, sentence {index}"
            try:
                query = query_text(sentence)
                meta = {"vid": video_id, QUERY_KEY: query, "sentence_index": index,
                        FORMAT_KEY: "activitynet-captions"}
                yield _record(clip, prompt, query, [_window(pair)], meta, declared, here)
            except RecordError as error:
                yield RecordError(f"{here}: {error}")


def _length(value: Any) -> str:
    return f"{len(value)} items" if isinstance(value, list) else type(json_text.plain(value)).__name__


def _qvhighlights_line(folder: ClipFolder, prompt: str, number: int, line: str, where: list[str]) -> dict:
    entry = _loads(line)
    if not isinstance(entry, dict):
        raise RecordError("a QVHighlights line is a JSON object")
    video_id = entry.get("vid")
    if not isinstance(video_id, str) or not video_id.strip():
        raise RecordError(f"needs 'vid', the clip's id, got {json_text.plain(video_id)!r}")
    where += [f"video {video_id}"] + ([f"qid {entry['qid']}"] if isinstance(entry.get("qid"), Number) else [])
    windows = entry.get("relevant_windows")
    if windows is None:
        raise RecordError("has no 'relevant_windows' (QVHighlights' test split does not publish them): nothing to "
                          "train or score")
    if not isinstance(windows, list) or not windows:
        raise RecordError(f"'relevant_windows' must be a list of [start, end] windows, got "
                          f"{json_text.plain(windows)!r}")
    spans = [_nth_window(index, window) for index, window in enumerate(windows)]
    query = query_text(entry.get("query"))
    declared = _declared(entry.get("duration"))
    clip = folder.find(video_id, CLIP_NAMES["qvhighlights"])
    scalars = {key: value for key, value in entry.items()
               if key != "duration" and isinstance(value, (str, bool, Number))}
    meta = {**scalars, QUERY_KEY: query, "line": number, FORMAT_KEY: "qvhighlights"}
    return _record(clip, prompt, query, spans, meta, declared, ", ".join(where), several=True)


def iter_qvhighlights(path: Path, folder: ClipFolder, prompt: str) -> Iterator[dict | RecordError]:
    """QVHighlights' queries, one record each with all of its windows."""
    return _per_line(path, partial(_qvhighlights_line, folder, prompt))


_READERS = {"charades-sta": iter_charades, "activitynet-captions": iter_activitynet, "qvhighlights": iter_qvhighlights}


def iter_dataset(path: Path, fmt: str, video_dir: Path, prompt: str) -> Iterator[dict | RecordError]:
    """The canonical records of one of ``FORMATS``, in file order, their clips found in ``video_dir``; a bad line,
    entry or sentence is one RecordError naming where it is."""
    return _READERS[fmt](path, ClipFolder(video_dir), prompt)
