"""Finding and rewriting coordinates in grounding answers (pure functions, shared by convert, rewards and eval).

Formats: Qwen2.5-VL / Qwen3-VL JSON ``[{"bbox_2d": [x1, y1, x2, y2], "label": ...}]`` (also ``point_2d``), bare or
inside a json code fence; Qwen2-VL ``<|box_start|>(x1,y1),(x2,y2)<|box_end|>``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

_FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL)
_BOX_TOKENS = re.compile(
    r"<\|box_start\|>\s*\(\s*([-+0-9.eE]+)\s*,\s*([-+0-9.eE]+)\s*\)\s*,\s*\(\s*([-+0-9.eE]+)\s*,\s*([-+0-9.eE]+)\s*\)"
    r"\s*<\|box_end\|>"
)
_REF = re.compile(r"<\|object_ref_start\|>(.*?)<\|object_ref_end\|>\s*$", re.DOTALL)
COORD_KEYS = ("bbox_2d", "point_2d")


class AnswerError(ValueError):
    """An answer whose coordinates cannot be read (malformed JSON, wrong arity, non-numbers)."""


@dataclass(frozen=True)
class Item:
    """One grounded object: ``kind`` is ``bbox_2d`` or ``point_2d``; ``coords`` flat x, y values."""

    kind: str
    coords: tuple[float, ...]
    label: str | None = None


def _json_payload(text: str) -> tuple[Any, tuple[int, int]] | None:
    """The JSON value of the answer (fenced or bare) and its character span, or None if it is not JSON."""
    fence = _FENCE.search(text)
    region_start, region = (fence.start(1), fence.group(1)) if fence else (0, text)
    body = region.strip()
    if not fence and not body.startswith(("[", "{")):
        return None
    start = region_start + region.index(body[0]) if body else region_start
    span = (start, start + len(body))
    try:
        return json.loads(body), span
    except json.JSONDecodeError as exc:
        if any(key in body for key in COORD_KEYS):
            raise AnswerError(f"answer JSON does not parse: {exc.msg} at position {exc.pos}") from None
        return None


def _entries(payload: Any) -> list[dict]:
    if isinstance(payload, dict):
        payload = [payload]
    if not isinstance(payload, list):
        return []
    return [entry for entry in payload if isinstance(entry, dict) and any(k in entry for k in COORD_KEYS)]


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AnswerError(f"coordinate {value!r} is not a number")
    if not math.isfinite(value):
        raise AnswerError(f"coordinate {value!r} is not finite")
    return float(value)


def _item(entry: dict) -> Item:
    kind = "bbox_2d" if "bbox_2d" in entry else "point_2d"
    values = entry[kind]
    arity = 4 if kind == "bbox_2d" else 2
    if not isinstance(values, list) or len(values) != arity:
        raise AnswerError(f"{kind} must be a list of {arity} numbers, got {values!r}")
    label = entry.get("label")
    return Item(kind, tuple(_number(v) for v in values), None if label is None else str(label))


@dataclass
class ParsedAnswer:
    """An answer parsed once: its items, and what is needed to rewrite their coordinates in its own syntax."""

    text: str
    items: list[Item]
    payload: Any = None
    span: tuple[int, int] | None = None

    def rewrite(self, transform: Callable[[Item], Sequence[float]]) -> str:
        """The answer with every item's coordinates replaced by ``transform(item)``; unchanged if it has none."""
        if not self.items:
            return self.text
        if self.span is not None:
            for entry, item in zip(_entries(self.payload), self.items):
                entry[item.kind] = [_format_number(v) for v in transform(item)]
            start, end = self.span
            return self.text[:start] + json.dumps(self.payload, ensure_ascii=False) + self.text[end:]
        coords = iter([[_format_number(v) for v in transform(item)] for item in self.items])

        def replace(match: re.Match) -> str:
            x1, y1, x2, y2 = next(coords)
            return f"<|box_start|>({x1},{y1}),({x2},{y2})<|box_end|>"

        return _BOX_TOKENS.sub(replace, self.text)


def parse_answer(text: str) -> ParsedAnswer:
    """Parse boxes and points; AnswerError when they are malformed."""
    found = _json_payload(text)
    if found is not None:
        payload, span = found
        return ParsedAnswer(text, [_item(entry) for entry in _entries(payload)], payload, span)
    items = []
    for match in _BOX_TOKENS.finditer(text):
        try:
            coords = tuple(_number(float(v)) for v in match.groups())
        except ValueError:
            raise AnswerError(f"box {match.group(0)!r} has a non-number") from None
        ref = _REF.search(text[: match.start()])
        items.append(Item("bbox_2d", coords, ref.group(1).strip() if ref else None))
    return ParsedAnswer(text, items)


def parse_items(text: str) -> list[Item]:
    """All boxes and points in an answer; [] when it has none; AnswerError when they are malformed."""
    return parse_answer(text).items


def _format_number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value
