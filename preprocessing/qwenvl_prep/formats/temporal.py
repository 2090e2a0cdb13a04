"""Video grounding layouts -> canonical records with one video each (``--format video-span`` / ``video-track``).

- ``video-span`` (a user's own span files, JSON array or JSONL; the datasets' own files are temporal_datasets'):
  ``{"video": path, "query" | "sentence": text, "timestamp" | "span" | "timestamps": [start, end] (or [[start, end]]), "duration": seconds}``
  (``duration`` optional). ``"sentences": [...]`` with ``"timestamps": [[s, e], ...]`` gives one record per sentence.
  The answer is ``{"span": [start, end]}`` in seconds.
- ``video-track`` (per-frame box tracks): ``{"video": path, "query": text, "track": [{"time": seconds, "bbox":
  [x, y, w, h]} | {"time": seconds, "bbox_2d": [x1, y1, x2, y2]}, ...]}``. The answer is the track as ``[{"time": t,
  "bbox_2d": [x1, y1, x2, y2], "label": ...}]`` in the input's coordinates, which convert maps into the video frame
  like any box (``--input-coords``); an empty track answers ``[]`` (not in the video).

The prompt is a template with ``{query}``. Structure is checked here (numbers, start < end, times >= 0); whether a
span or a time lies inside the clip, and a declared ``duration`` is the clip's, is checked by convert once the clip
is probed (``meta.duration`` is then the clip's length from its packets). The other scalar fields of an entry
(``id``, ...) go to ``meta``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

from qwenvl_prep.formats.records import RecordError, iter_raw
from qwenvl_prep.lf.dataset_rules import special_token_problem

FORMATS = ("video-span", "video-track")
PROMPTS = {
    "video-span": 'When does "{query}" happen in the video? Output its start and end in seconds as JSON: '
                  '{"span": [start, end]}.',
    "video-track": 'Track "{query}" in the video: output its bbox_2d at each time as JSON: '
                   '[{"time": seconds, "bbox_2d": [x1, y1, x2, y2]}].',
}
MEDIA_TAGS = ("<image>", "<video>", "<audio>")
QUERY_KEY = "query"  # meta: a record's query, which a video prompt preset asks again in its own words
ORIGIN_KEY = "origin"  # where a record comes from in its file ("entry 3"): convert's error rows name it
_SPAN_KEYS = ("timestamp", "span", "timestamps")
_QUERY_KEYS = ("query", "sentence", "caption")
_CARRIED = {"video", "track", "sentences", "duration", *_SPAN_KEYS, *_QUERY_KEYS}  # convert writes meta.duration


def check_prompt(prompt: str) -> None:
    """A template must place the query once and carry no media tag (convert adds the one video tag)."""
    if prompt.count("{query}") != 1:
        raise ValueError(f"--prompt {prompt!r} must contain {{query}} exactly once: it is where each record's query "
                         "goes")
    if any(tag in prompt for tag in MEDIA_TAGS):
        raise ValueError(f"--prompt {prompt!r} contains a media tag; convert adds the video's <video> tag itself")
    if (problem := special_token_problem(prompt)) is not None:
        raise ValueError(f"--prompt {prompt!r} holds {problem}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _video(entry: dict) -> str | list[str]:
    video = entry.get("video")
    if isinstance(video, str) and video.strip():
        return video
    if isinstance(video, list) and video and all(isinstance(p, str) for p in video):
        return video  # a frame list
    raise RecordError(f"entry needs 'video': a path (or a frame list: a list of image paths), got {video!r}")


def query_text(value: Any) -> str:
    """A record's query, stripped: non-empty text without a media tag (LF would read one as another media item)."""
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"the query must be non-empty text, got {value!r}")
    tag = next((tag for tag in MEDIA_TAGS if tag in value), None)
    if tag:
        raise RecordError(f"the query {value[:80]!r} contains {tag}, which LLaMA-Factory would read as another media "
                          "item")
    return value.strip()


def _query(value: Any, video: Any) -> str:
    try:
        return query_text(value)
    except RecordError as error:
        raise RecordError(f"video {_name(video)}: {error}") from None


def _name(video: Any) -> str:
    return video if isinstance(video, str) else f"frame list of {len(video)} frames (first {video[0]})"


def _span(value: Any, video: Any, query: str) -> list[float]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]  # [[start, end]]
    if not (isinstance(value, list) and len(value) == 2 and all(map(_number, value))):
        raise RecordError(f"video {_name(video)}, query {query[:60]!r}: the span {value!r} must be [start, end] in "
                          "seconds")
    start, end = value
    if start < 0 or end <= start:
        raise RecordError(f"video {_name(video)}, query {query[:60]!r}: the span [{start:g}, {end:g}] lies outside "
                          "the clip (need 0 <= start < end, in seconds)")
    return [start, end]


def _duration(entry: dict, video: Any) -> dict:
    if "duration" not in entry:
        return {}
    if not _number(entry["duration"]) or entry["duration"] <= 0:
        raise RecordError(f"video {_name(video)}: 'duration' {entry['duration']!r} must be a number of seconds > 0")
    return {"declared_duration": entry["duration"]}


def _meta(entry: dict, extra: dict) -> dict:
    scalars = {k: v for k, v in entry.items() if k not in _CARRIED and (isinstance(v, (str, bool)) or _number(v))}
    return {**scalars, **extra}


def video_record(video: Any, prompt: str, query: str, answer: str, meta: dict, declared: dict) -> dict:
    """The canonical record of one video question: the prompt with its query after the video's tag, the answer."""
    return {"messages": [{"role": "user", "content": "<video>" + prompt.replace("{query}", query)},
                         {"role": "assistant", "content": answer}],
            "images": [], "videos": [video], "meta": meta, **declared}


def span_records(entry: dict, prompt: str) -> list[dict]:
    """The records of one span entry: one, or one per sentence of an ActivityNet-style entry."""
    video = _video(entry)
    declared = _duration(entry, video)
    key = next((k for k in _SPAN_KEYS if k in entry), None)
    if key is None:
        raise RecordError(f"video {_name(video)}: the entry has no span ('timestamp', 'span' or 'timestamps')")
    sentences = entry.get("sentences")
    if isinstance(sentences, list):
        spans = entry[key]
        if not (isinstance(spans, list) and len(spans) == len(sentences)
                and all(isinstance(s, list) for s in spans)):
            raise RecordError(f"video {_name(video)}: {len(sentences)} sentences need as many [start, end] pairs "
                              f"under {key!r}, got {spans!r}"[:300])
        pairs = [(_query(s, video), span) for s, span in zip(sentences, spans)]
    else:
        query_key = next((k for k in _QUERY_KEYS if k in entry), "query")
        pairs = [(_query(entry.get(query_key), video), entry[key])]
    out = []
    for number, (query, span) in enumerate(pairs):
        answer = json.dumps({"span": _span(span, video, query)})
        extra = {QUERY_KEY: query, **({"sentence_index": number} if isinstance(sentences, list) else {})}
        out.append(video_record(video, prompt, query, answer, _meta(entry, extra), declared))
    return out


def track_records(entry: dict, prompt: str) -> list[dict]:
    """The record of one track entry."""
    video = _video(entry)
    query = _query(entry.get("query", entry.get("sentence")), video)
    track = entry.get("track")
    if not isinstance(track, list):
        raise RecordError(f"video {_name(video)}, query {query[:60]!r}: 'track' must be a list of "
                          "{\"time\", \"bbox\" | \"bbox_2d\"} objects")
    label = next((entry[k] for k in ("label", "category") if isinstance(entry.get(k), str)), query)
    answer = []
    for number, point in enumerate(track):
        where = f"video {_name(video)}, query {query[:60]!r}, track entry {number}"
        if not isinstance(point, dict) or not _number(point.get("time")) or point["time"] < 0:
            raise RecordError(f"{where}: needs a 'time' in seconds >= 0 (the time lies outside the clip), got "
                              f"{point.get('time') if isinstance(point, dict) else point!r}")
        box = point.get("bbox_2d", point.get("bbox"))
        if not (isinstance(box, list) and len(box) == 4 and all(map(_number, box))):
            raise RecordError(f"{where}: its box {box!r} is not 4 numbers")
        if "bbox_2d" not in point:
            box = [box[0], box[1], box[0] + box[2], box[1] + box[3]]  # [x, y, w, h] -> corners
        if box[2] <= box[0] or box[3] <= box[1]:
            raise RecordError(f"{where}: its box {box!r} has no area")
        answer.append({"time": point["time"], "bbox_2d": box,
                       "label": point["label"] if isinstance(point.get("label"), str) else label})
    return [video_record(video, prompt, query, json.dumps(answer), _meta(entry, {QUERY_KEY: query}),
                         _duration(entry, video))]


_READERS = {"video-span": span_records, "video-track": track_records}


def iter_temporal(path: Path, fmt: str, prompt: str) -> Iterator[dict | RecordError]:
    """The canonical records of a ``video-span`` or ``video-track`` file, in file order; a bad entry is one
    RecordError naming its line (entry) number and video."""
    for number, raw in enumerate(iter_raw(path), start=1):
        try:
            if isinstance(raw, RecordError):
                raise raw
            entry = json.loads(raw)
            if not isinstance(entry, dict):
                raise RecordError(f"a {fmt} entry is an object, got {type(entry).__name__}")
            for record in _READERS[fmt](entry, prompt):
                yield {**record, ORIGIN_KEY: f"entry {number}"}
        except RecordError as error:
            yield RecordError(f"entry {number}: {error}")
        except (ValueError, RecursionError) as error:
            yield RecordError(f"entry {number} is not valid JSON ({error})")
