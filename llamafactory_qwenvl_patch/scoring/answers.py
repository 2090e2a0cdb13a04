"""Finding and rewriting coordinates in grounding texts (pure functions, shared by convert, rewards and eval).

Formats: Qwen2.5-VL / Qwen3-VL JSON ``[{"bbox_2d": [x1, y1, x2, y2], "label": ...}]`` (also ``point_2d``), bare,
in code fences or embedded in prose, under any key and even double-encoded; Qwen2-VL
``<|box_start|>(x1,y1),(x2,y2)<|box_end|>``. Every coordinate the parser can see is an item; coordinate-like text
it cannot place is an AnswerError, so no coordinate is ever silently left in another frame.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from llamafactory_qwenvl_patch.scoring import json_text
from llamafactory_qwenvl_patch.scoring.json_text import JSONTextError, Number, Span

FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL)  # a code fence and its body
_BOX_TOKENS = re.compile(
    r"<\|box_start\|>\s*\(\s*([-+0-9.eE]+)\s*,\s*([-+0-9.eE]+)\s*\)\s*,\s*\(\s*([-+0-9.eE]+)\s*,\s*([-+0-9.eE]+)\s*\)"
    r"\s*<\|box_end\|>"
)
_REF = re.compile(r"<\|object_ref_start\|>(.*?)<\|object_ref_end\|>\s*$", re.DOTALL)
COORD_KEYS = ("bbox_2d", "point_2d")


# An answer longer than a model writes is a parse failure, found by a linear count before any parsing: matching and
# the duplicate monitors are quadratic in one answer's boxes (100,000 boxes stalled eval for minutes). The bound is
# the most items MAX_ANSWER_TOKENS new tokens can hold: 8 times LLaMA-Factory's default max_new_tokens (1,024), 64
# times predict's (128). The shortest item, a span ``{"span":[0,0]}`` in a list, is 6 of the Qwen pre-tokenizer's
# pieces (a point is 9, a box token 11), and no BPE vocabulary merges across them (tests/unit/scoring checks it).
MAX_ANSWER_TOKENS = 8192
MIN_ITEM_TOKENS = 6
MAX_ANSWER_ITEMS = MAX_ANSWER_TOKENS // MIN_ITEM_TOKENS  # 1,365
_ITEM_MARKS = ("bbox_2d", "point_2d", "<|box_start|>", '"span"')  # one in every box, point, span or track entry
_ASCII_ESCAPE = re.compile(r"\\u00([0-7][0-9a-fA-F])")  # ``\u0062`` in JSON (deeper encodings add backslashes)


def _as_read(text: str) -> str:
    r"""``text`` with JSON's escapes of ASCII characters decoded and backslashes dropped, at every depth of encoding
    the parser reads: ``"\u0062box_2d"`` and a double-encoded ``\"span\"`` are counted as the keys they decode to.
    Linear in the text (no backtracking over runs of backslashes). A label whose own text spells a key so escaped
    counts too, as a label naming a key does."""
    if "\\" not in text:
        return text
    return _ASCII_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text).replace("\\", "")


def too_many_items(text: str) -> str | None:
    """Why ``text`` is no model's answer: it has more boxes, points or spans (their keys or tokens counted as the
    parser would read them, so a label that names one counts too) than ``MAX_ANSWER_ITEMS``; None when it has not."""
    text = _as_read(text)
    count = sum(text.count(mark) for mark in _ITEM_MARKS)
    if count <= MAX_ANSWER_ITEMS:
        return None
    return (f"the answer has {count} boxes, points or spans, more than a model writes in {MAX_ANSWER_TOKENS} new "
            f"tokens ({MAX_ANSWER_ITEMS}, at {MIN_ITEM_TOKENS} tokens or more each)")


class AnswerError(ValueError):
    """An answer whose coordinates cannot be read (malformed JSON, wrong arity, non-numbers)."""


@dataclass(frozen=True)
class Item:
    """One grounded object: ``kind`` is ``bbox_2d`` or ``point_2d``; ``coords`` flat x, y values."""

    kind: str
    coords: tuple[float, ...]
    label: str | None = None


# What a coordinate looks like outside readable JSON: a key with a number after it, or a box token. The bare words
# (prompts say "output the bbox_2d coordinates") are not coordinates.
_COORD_TEXT = re.compile(r"(?:bbox_2d|point_2d)[\"']?\s*[:=]\s*[\[(]?\s*[-+]?\.?\d|<\|box_start\|>|<\|box_end\|>")


def _has_coords(value: Any) -> bool:
    if isinstance(value, dict):
        return any(k in COORD_KEYS for k in value) or any(_has_coords(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_coords(v) for v in value)
    if isinstance(value, str) and any(k in value for k in COORD_KEYS):
        inner = _loads(value)
        return inner is not None and _has_coords(inner)
    return False


def _loads(text: str) -> Any:
    """The JSON value of ``text`` as written (``json_text``), None when it is not JSON; AnswerError when it is JSON
    that cannot be taken as written (a repeated key, nesting beyond ``json_text.MAX_DEPTH``)."""
    try:
        return json_text.loads(text, allow_nan=True)  # a NaN coordinate is named by _number
    except JSONTextError as exc:
        raise AnswerError(str(exc)) from None
    except ValueError:
        return None


def _walk(value: Any, visit: Callable[[str, Any, dict], Any]) -> None:
    """Call ``visit(kind, coords, entry)`` for every coordinate list in ``value``, in text order: dict keys in order
    (a ``bbox_2d`` and a ``point_2d`` of one object are both visited), lists in order, and JSON text inside a string
    (double-encoded JSON) decoded and walked."""
    if isinstance(value, dict):
        for k, v in value.items():
            visit(k, v, value) if k in COORD_KEYS else _walk(v, visit)
    elif isinstance(value, list):
        for v in value:
            _walk(v, visit)
    elif isinstance(value, str) and any(k in value for k in COORD_KEYS):
        inner = _loads(value)
        if inner is not None and _has_coords(inner):
            _walk(inner, visit)


def _coordinate_ordinals(value: Any, out: list[list[int]], seen: list[int]) -> bool:
    """``_walk``'s order over a parsed value: append, per coordinate list, the ordinals of its numbers among all the
    value's numbers in text order (``seen[0]`` counts them). False when coordinates sit inside a string
    (double-encoded JSON): their place in the text needs ``json_text.spans``."""
    if isinstance(value, Number):
        seen[0] += 1
    elif isinstance(value, dict):
        for key, child in value.items():
            if key in COORD_KEYS and isinstance(child, list) and all(isinstance(v, Number) for v in child):
                out.append(list(range(seen[0], seen[0] + len(child))))
                seen[0] += len(child)
            elif not _coordinate_ordinals(child, out, seen):
                return False
    elif isinstance(value, list):
        return all(_coordinate_ordinals(child, out, seen) for child in value)
    elif isinstance(value, str) and any(k in value for k in COORD_KEYS):
        inner = _loads(value)
        return inner is None or not _has_coords(inner)
    return True


def _site_spans(text: str, site: "_Site", out: list[list[tuple[int, int]]]) -> None:
    """Where the numbers of each coordinate list of a JSON site lie in ``text``: by counting numbers (fast), or,
    for coordinates inside a string, by walking the site's tokens (``json_text.spans``)."""
    ordinals: list[list[int]] = []
    seen = [0]
    if _coordinate_ordinals(site.value, ordinals, seen):
        numbers = json_text.number_spans(text, site.start, site.end)
        if len(numbers) == seen[0]:
            out.extend([numbers[i] for i in row] for row in ordinals)
            return
    _coordinate_spans(json_text.spans(text, site.start)[0], lambda i: i, out)


def _coordinate_spans(tree: Any, where: Callable[[int], int], out: list[list[tuple[int, int]]]) -> None:
    """``_walk``'s order over a ``json_text.spans`` tree: append, per coordinate list, where its numbers lie in the
    text (``where`` maps a position inside a decoded string back to the text)."""
    if isinstance(tree, list):
        for entry in tree:
            key, child = entry if isinstance(entry, tuple) else (None, entry)
            if key in COORD_KEYS:
                out.append([(where(span.start), where(span.end)) for span in child])
            else:
                _coordinate_spans(child, where, out)
    elif isinstance(tree, Span) and tree.decoded is not None and any(k in tree.decoded for k in COORD_KEYS):
        inner = _loads(tree.decoded)
        if inner is not None and _has_coords(inner):
            offsets = tree.offsets
            _coordinate_spans(json_text.spans(tree.decoded)[0], lambda i: where(offsets[i]), out)


@dataclass(frozen=True)
class _Site:
    """Where coordinates sit in the text: a JSON value (``value``) or Qwen2-VL box tokens (``value`` None)."""

    start: int
    end: int
    value: Any = None


def _json_sites(text: str, wanted: Callable[[Any], bool] = _has_coords,
                marker: re.Pattern[str] = _COORD_TEXT) -> list[_Site]:
    """Every JSON value ``wanted`` accepts (by default: with coordinates): the whole text (even a double-encoded
    string), or each code fence's body, then values embedded in the remaining text. A fence whose body is not JSON
    but holds text ``marker`` finds is an AnswerError."""
    stripped = text.strip()
    whole = _loads(stripped) if stripped[:1] in ('"', "[", "{") else None
    if whole is not None and wanted(whole):
        start = text.index(stripped[0])
        return [_Site(start, start + len(stripped), whole)]
    sites: list[_Site] = []
    for fence in FENCE.finditer(text):
        body = fence.group(1)
        stripped = body.strip()
        value = _loads(stripped)
        if value is None:
            if marker.search(body):
                raise AnswerError(f"a code fence with coordinates does not parse as JSON: {stripped[:80]!r}")
            continue
        if wanted(value):
            start = fence.start(1) + body.index(stripped[0]) if stripped else fence.start(1)
            sites.append(_Site(start, start + len(stripped), value))
    fenced = [(f.start(), f.end()) for f in FENCE.finditer(text)]
    try:
        for start, end, value in json_text.embedded(text, _raw_decode, skip=fenced):
            if wanted(value):
                sites.append(_Site(start, end, value))
    except JSONTextError as exc:
        raise AnswerError(str(exc)) from None
    return sites


def _raw_decode(text: str, start: int) -> tuple[Any, int]:
    return json_text.raw_decode(text, start, allow_nan=True)  # a NaN coordinate is named by read_number


def _token_sites(text: str, taken: list[_Site]) -> list[_Site]:
    return [_Site(m.start(), m.end()) for m in _BOX_TOKENS.finditer(text)
            if not any(s.start <= m.start() < s.end for s in taken)]


def _check_nothing_left(text: str, sites: list[_Site], marker: re.Pattern[str] = _COORD_TEXT,
                        expected: str = "bbox_2d / point_2d JSON or box tokens") -> None:
    """Coordinate-like text (``marker``) outside every site it could read is an error, never a silent
    pass-through."""
    rest, last = [], 0
    for site in sorted(sites, key=lambda s: s.start):
        rest.append(text[last:site.start])
        last = site.end
    rest.append(text[last:])
    leftover = marker.search("".join(rest))
    if leftover:
        joined = "".join(rest)
        around = joined[max(0, leftover.start() - 30):leftover.end() + 30]
        raise AnswerError(f"the text has coordinates that cannot be read as {expected}: {around!r}")


def read_coords(kind: str, values: Any) -> tuple[float, ...]:
    """A ``bbox_2d`` (4 numbers) or ``point_2d`` (2) as finite floats; AnswerError for another arity or a value that
    is not a finite number. Boxes, points and GUI actions (``actions``) read their coordinates here."""
    arity = 4 if kind == "bbox_2d" else 2
    if not isinstance(values, list) or len(values) != arity:
        raise AnswerError(f"{kind} must be a list of {arity} numbers, got {values!r}")
    return tuple(read_number(v) for v in values)


def _entry_item(kind: str, values: Any, entry: dict) -> Item:
    coords = read_coords(kind, values)
    label = entry.get("label")
    return Item(kind, coords, None if label is None else str(label))


def _token_item(text: str, site: _Site) -> Item:
    match = _BOX_TOKENS.match(text, site.start)
    try:
        coords = tuple(read_number(float(v)) for v in match.groups())
    except ValueError:
        raise AnswerError(f"box {match.group(0)!r} has a non-number") from None
    ref = _REF.search(text[: site.start])
    return Item("bbox_2d", coords, ref.group(1).strip() if ref else None)


def read_number(value: Any, what: str = "coordinate") -> float:
    """A JSON number as written (``json_text.Number`` or a plain one) as a finite float; AnswerError naming ``what``
    for a bool, a string, an overflowing or a non-finite value (coordinates here, times in ``temporal``)."""
    if isinstance(value, Number):
        value = value.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AnswerError(f"{what} {value!r} is not a number")
    try:
        number = float(value)
    except OverflowError:
        raise AnswerError(f"{what} {str(value)[:20]}... is too large") from None
    if not math.isfinite(number):
        raise AnswerError(f"{what} {value!r} is not finite")
    return number


@dataclass
class ParsedAnswer:
    """A text parsed once: every coordinate site in text order, its items, and how to write them back."""

    text: str
    items: list[Item]
    sites: list[_Site]

    def rewrite(self, transform: Callable[[Item], Sequence[float]]) -> str:
        """The text with every item's coordinates replaced by ``transform(item)``, number by number: everything
        else (other numbers as written, spacing, key order, escapes) stays byte for byte."""
        if not self.items:
            return self.text
        where: list[list[tuple[int, int]]] = []
        for site in self.sites:
            if site.value is None:
                match = _BOX_TOKENS.match(self.text, site.start)
                where.append([match.span(g) for g in range(1, 5)])
            else:
                _site_spans(self.text, site, where)
        if [len(w) for w in where] != [len(item.coords) for item in self.items]:
            raise RuntimeError(f"coordinates found twice in different places in {self.text[:200]!r}; please report")
        edits = sorted((span, _format_number(v)) for item, spans in zip(self.items, where)
                       for span, v in zip(spans, transform(item)))
        out, last = [], 0
        for (start, end), value in edits:
            out += [self.text[last:start], str(value)]
            last = end
        out.append(self.text[last:])
        return "".join(out)


def parse_answer(text: str) -> ParsedAnswer:
    """Every box and point in a text: JSON (bare, fenced, several fences, embedded in prose, nested under any key,
    double-encoded) and Qwen2-VL box tokens. AnswerError when coordinates are malformed or when coordinate-like text
    is left that none of these forms can read."""
    sites = _json_sites(text)
    sites = sorted(sites + _token_sites(text, sites), key=lambda site: site.start)
    _check_nothing_left(text, sites)
    items: list[Item] = []
    for site in sites:
        if site.value is None:
            items.append(_token_item(text, site))
        else:
            _walk(site.value, lambda kind, values, entry: items.append(_entry_item(kind, values, entry)))
    return ParsedAnswer(text, items, sites)


def json_values(text: str, wanted: Callable[[Any], bool], marker: re.Pattern[str], expected: str) -> list[Any]:
    """The JSON values of ``text`` that ``wanted`` accepts, in text order, found as boxes are (the whole text, code
    fences, embedded in prose; read as written); AnswerError when text ``marker`` finds is left that none of them
    holds, or a value cannot be taken as written. How the video answers (``temporal``) share this parser's
    robustness."""
    sites = sorted(_json_sites(text, wanted, marker), key=lambda site: site.start)
    _check_nothing_left(text, sites, marker, expected)
    return [site.value for site in sites]


def parse_items(text: str) -> list[Item]:
    """All boxes and points in an answer; [] when it has none; AnswerError when they are malformed."""
    return parse_answer(text).items


def try_parse_items(text: str) -> list[Item] | None:
    """All boxes and points of a model's answer, or None when they are malformed or more than a model writes
    (``too_many_items``): rewards, metrics and drawings score such an answer as a parse failure instead of
    stopping."""
    if too_many_items(text) is not None:
        return None
    try:
        return parse_answer(text).items
    except AnswerError:
        return None


def not_present(text: str) -> bool:
    """An answer saying "nothing here": exactly an empty JSON list, bare or in one code fence (convert's "not present"
    samples, ``--coco-absent``). As a reference, scored as a grounding record with no truth box, never as an empty
    field-extraction array; as a model's answer, the right answer to such a record."""
    stripped = text.strip()
    fence = FENCE.fullmatch(stripped)
    return _EMPTY_LIST.fullmatch(fence.group(1) if fence else stripped) is not None


_EMPTY_LIST = re.compile(r"\s*\[\s*\]\s*")


_BARE_POINT = re.compile(r"\s*[\[(]\s*([-+]?\d+(?:\.\d+)?)\s*,\s*([-+]?\d+(?:\.\d+)?)\s*[\])]\s*")


def bare_point(text: str) -> tuple[float, float] | None:
    """A click given as nothing but ``[x, y]`` or ``(x, y)`` (bare or alone in a code fence), the answer style of
    several GUI-agent datasets; None for any other text. Only a whole answer counts: a pair inside prose is not a
    coordinate claim."""
    fence = FENCE.fullmatch(text.strip())
    match = _BARE_POINT.fullmatch(fence.group(1) if fence else text)
    return (float(match.group(1)), float(match.group(2))) if match else None


def _format_number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value
