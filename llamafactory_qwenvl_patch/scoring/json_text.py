"""JSON read as it was written: every number keeps its text, a repeated key is an error, nesting is bounded.

Labels must reach training byte for byte. ``json.loads`` turns ``300.00`` into ``300.0``, ``1e2`` into ``100.0`` and an
integer beyond 64 bits into a float, and keeps only the last of two equal keys (a box vanishes without a word); a
value nested a few hundred levels deep makes every recursive walker raise ``RecursionError``. Here numbers are
``Number`` objects that keep their text, a repeated key raises ``DuplicateKeyError`` naming it, and a value nested
deeper than ``MAX_DEPTH`` raises ``TooDeepError``. ``spans`` finds where each number and string of a JSON text lies,
for rewriting coordinates in place.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterator, Sequence

MAX_DEPTH = 100  # objects and arrays nested deeper than this are refused (real labels nest a few levels)
MAX_NUMBER_CHARS = 300  # a longer number is refused: every integer this long still converts to a float


class JSONTextError(ValueError):
    """A JSON text that parses but cannot be taken as written."""


class DuplicateKeyError(JSONTextError):
    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} appears twice in one JSON object; only one of the values would be kept")
        self.key = key


class TooDeepError(JSONTextError):
    def __init__(self) -> None:
        super().__init__(f"a JSON value is nested more than {MAX_DEPTH} levels deep")


class NumberTooLongError(JSONTextError):
    def __init__(self, text: str) -> None:
        super().__init__(f"a number written with {len(text)} characters ({text[:12]}...) is too large: longer "
                         f"than the {MAX_NUMBER_CHARS} any coordinate or field can need")


class Number:
    """A JSON number and its text as written (``300.00`` stays ``300.00``). Longer than ``MAX_NUMBER_CHARS`` it is
    refused as it is read: Python will not turn an integer of over 4,300 digits into an int, and one of over 308
    does not fit a float, so every later step (a box check, a reward, an IoU) would fail on it."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        if len(text) > MAX_NUMBER_CHARS:
            raise NumberTooLongError(text)
        self.text = text

    @property
    def value(self) -> int | float:
        """The Python number: an int for integer syntax (any size), else a float."""
        text = self.text
        return float(text) if "." in text or "e" in text or "E" in text else int(text)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Number({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Number) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An ``object_pairs_hook`` that refuses a repeated key (``DuplicateKeyError``) instead of keeping its last value;
    for readers that want Python's own numbers too (the field scores)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # Python's json reads NaN and Infinity; JSON has neither


_STRICT = json.JSONDecoder(object_pairs_hook=unique_keys, parse_float=Number, parse_int=Number,
                           parse_constant=_constant)
_LENIENT = json.JSONDecoder(object_pairs_hook=unique_keys, parse_float=Number, parse_int=Number)


def depth(value: Any) -> int:
    """How deeply objects and arrays nest in ``value`` (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            return level
        stack.extend((child, level + 1) for child in children)
    return deepest


def _bounded(value: Any, brackets: int | None = None) -> Any:
    """``value``, or TooDeepError; ``brackets`` (how many the text held) skips the walk when they are too few."""
    if (brackets is None or brackets > MAX_DEPTH) and depth(value) > MAX_DEPTH:
        raise TooDeepError()
    return value


def loads(text: str, allow_nan: bool = False) -> Any:
    """``text`` as JSON with ``Number`` leaves; ``ValueError`` (``DuplicateKeyError``, ``TooDeepError``, a syntax
    error) when it cannot be taken as written. ``allow_nan``: read ``NaN`` and ``Infinity`` as Python floats (as
    ``json.loads`` does), for callers that name them as bad values themselves."""
    try:
        value = (_LENIENT if allow_nan else _STRICT).decode(text)
    except RecursionError:
        raise TooDeepError() from None
    return _bounded(value, text.count("[") + text.count("{"))


def raw_decode(text: str, start: int = 0, allow_nan: bool = False) -> tuple[Any, int]:
    """The JSON value that starts at ``start`` and the index after it (as ``json.JSONDecoder.raw_decode``)."""
    try:
        value, end = (_LENIENT if allow_nan else _STRICT).raw_decode(text, start)
    except RecursionError:
        raise TooDeepError() from None
    return _bounded(value, text.count("[", start, end) + text.count("{", start, end)), end


MAX_STARTS = 64  # start positions ``embedded`` tries by default: bounds the work on long hostile text


def embedded(text: str, decode: Callable[[str, int], tuple[Any, int]] = raw_decode, max_starts: int = MAX_STARTS,
             skip: Sequence[tuple[int, int]] = (), not_json: tuple[type[Exception], ...] = (ValueError,)
             ) -> Iterator[tuple[int, int, Any]]:
    """``(start, end, value)`` of each JSON array or object in free text (a model's prose, a label), in text order:
    ``decode(text, i)`` is tried at each ``[`` or ``{`` after the previous value, at most ``max_starts`` times.

    The one scanner of answers (coordinates, video spans), field answers and video labels; each keeps its own rules
    through the parameters: ``decode`` (numbers as written, Python's numbers, or plain ``json`` that keeps the last
    of two equal keys), ``max_starts`` (the field answers take the first of 16), ``skip`` (``(start, end)`` regions
    not scanned and not counted: the code fences answers read apart) and ``not_json`` (the errors that mean "no JSON
    here, try the next bracket"; video labels add RecursionError). A ``JSONTextError`` (JSON that cannot be taken as
    written) is always raised to the caller."""
    i, tries = 0, 0
    while tries < max_starts:
        starts = [j for j in (text.find("[", i), text.find("{", i)) if j >= 0]
        if not starts:
            return
        j = min(starts)
        region = next((end for start, end in skip if start <= j < end), None)
        if region is not None:
            i = region
            continue
        tries += 1
        try:
            value, end = decode(text, j)
        except JSONTextError:
            raise
        except not_json:
            i = j + 1
            continue
        yield j, end, value
        i = end


def plain(value: Any) -> Any:
    """``value`` with every ``Number`` turned into its Python number (for code that computes with the values)."""
    if isinstance(value, Number):
        return value.value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def dumps(value: Any, separators: tuple[str, str] = (",", ":")) -> str:
    """JSON text of ``value`` (as read by ``loads``) with each number written as it was read; keys in order,
    non-ASCII characters kept. ValueError for NaN or infinity, which are not JSON."""
    item, colon = separators

    def encode(node: Any) -> Iterator[str]:
        if isinstance(node, Number):
            yield node.text
        elif isinstance(node, dict):
            yield "{"
            for n, (key, child) in enumerate(node.items()):
                yield (item if n else "") + json.dumps(str(key), ensure_ascii=False) + colon
                yield from encode(child)
            yield "}"
        elif isinstance(node, list):
            yield "["
            for n, child in enumerate(node):
                if n:
                    yield item
                yield from encode(child)
            yield "]"
        else:
            yield json.dumps(node, ensure_ascii=False, allow_nan=False)

    _bounded(value)
    return "".join(encode(value))


# --- where values lie in a JSON text ----------------------------------------------------------------------------

_NUMBER_OR_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)', re.DOTALL)


def number_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Where each number of the JSON text ``text[start:end]`` lies, in text order (numbers inside strings are text,
    not numbers): the order in which ``loads`` creates its ``Number`` objects."""
    return [m.span(1) for m in _NUMBER_OR_STRING.finditer(text, start, end) if m.group(1) is not None]


_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|([\[\]{},:])'
                    r"|(true|false|null|NaN|-?Infinity))", re.DOTALL)


class Span:
    """Where one scalar lies in a text: ``start``/``end``; for a string also its decoded value and, per decoded
    character, the index of the text where it starts (so spans inside a decoded string map back to the text)."""

    __slots__ = ("start", "end", "decoded", "offsets")

    def __init__(self, start: int, end: int, decoded: str | None = None, offsets: list[int] | None = None) -> None:
        self.start, self.end, self.decoded, self.offsets = start, end, decoded, offsets


def _string_offsets(text: str, start: int, end: int) -> tuple[str, list[int]]:
    """Decode the string literal ``text[start:end]`` and give each decoded character's start in ``text`` (plus
    one entry for the closing quote)."""
    chars, offsets, i = [], [], start + 1
    while i < end - 1:
        offsets.append(i)
        if text[i] != "\\":
            chars.append(text[i])
            i += 1
        elif text[i + 1] == "u":
            code = int(text[i + 2:i + 6], 16)
            i += 6
            if 0xD800 <= code < 0xDC00 and text[i:i + 2] == "\\u":  # a surrogate pair is one character
                code = 0x10000 + ((code - 0xD800) << 10) + (int(text[i + 2:i + 6], 16) - 0xDC00)
                i += 6
            chars.append(chr(code))
        else:
            chars.append(json.loads(f'"{text[i:i + 2]}"'))
            i += 2
    offsets.append(end - 1)
    return "".join(chars), offsets


def spans(text: str, start: int = 0) -> tuple[Any, int]:
    """The JSON value at ``start`` of a text that ``raw_decode`` accepts, with every scalar replaced by its
    ``Span`` (objects as lists of ``(key, child)`` pairs, in text order), and the index after it."""
    root: list[Any] = []
    stack: list[tuple[list, bool]] = [(root, False)]  # (container, is_object)
    pending_key: str | None = None
    position = start
    while True:
        match = _TOKEN.match(text, position)
        if match is None:
            raise ValueError(f"not JSON at {position}")
        position = match.end()
        string, number, punct, literal = match.groups()
        container, is_object = stack[-1]
        if punct in ("[", "{"):
            child: list[Any] = []
            container.append((pending_key, child) if is_object else child)
            pending_key = None
            stack.append((child, punct == "{"))
            continue
        if punct in ("]", "}"):
            stack.pop()
        elif punct in (",", ":"):
            continue
        elif is_object and pending_key is None and string is not None:
            pending_key = json.loads(string)
            continue
        else:
            first = match.start(1) if string else match.start(2) if number else match.start(4)
            if string is not None:
                decoded, offsets = _string_offsets(text, first, position)
                span = Span(first, position, decoded, offsets)
            else:
                span = Span(first, position)
            container.append((pending_key, span) if is_object else span)
            pending_key = None
        if len(stack) == 1:
            return root[0], position
