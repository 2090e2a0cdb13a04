"""The items of a top-level JSON array (or the members of a top-level object) as their raw text, streamed.

Each item is handed on as text, like a JSONL line, so that it is parsed as written (``json_text``: number text kept,
a repeated key refused) and in the workers. A streaming parser such as ijson builds Python values: it rounds numbers
to floats and keeps the last of two equal keys, so the labels would not reach training as written.
"""

from __future__ import annotations

import json
import re
from typing import IO, Iterator

_SCAN = re.compile(rb'"(?:[^"\\]|\\.)*"|["\[\]{}]', re.DOTALL)  # a whole string, a cut-off quote, or a bracket
_SPACE = re.compile(rb"\s*")
_SCALAR_END = re.compile(rb"[,\]}\s]")  # a scalar ends at a separator, a closing bracket or space
CHUNK = 1 << 20
_ARRAY_END, _OBJECT_END = "the array's closing ']'", "the object's closing '}'"


class ArraySyntaxError(ValueError):
    """The array's (or object's) own punctuation is broken at ``offset``; nothing after it can be read."""

    def __init__(self, offset: int, what: str) -> None:
        super().__init__(f"byte {offset}: {what}")


class _Buffer:
    """A sliding window over the file: ``data[0]`` is byte ``base`` of the file."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.data, self.base, self.eof = f, b"", 0, False

    def more(self) -> bool:
        if self.eof:
            return False
        chunk = self.f.read(CHUNK)
        self.eof = not chunk
        self.data += chunk
        return bool(chunk)

    def drop(self, upto: int) -> int:
        """Forget everything before ``upto`` once it fills a chunk (cutting the window at every item copied it once
        per item: 15,000 small items took seconds); returns the index that byte has now."""
        if upto < CHUNK:
            return upto
        self.base += upto
        self.data = self.data[upto:]
        return 0

    def skip_space(self, pos: int) -> int:
        while True:
            pos = _SPACE.match(self.data, pos).end()
            if pos < len(self.data) or not self.more():
                return pos


def _item_end(buf: _Buffer, pos: int) -> int:
    """The index after the object or array that starts at ``pos``."""
    level, i = 0, pos
    while True:
        match = _SCAN.search(buf.data, i)
        if match is None or match.group() == b'"':  # nothing found yet, or a string that runs past the window
            i = match.start() if match else len(buf.data)
            if not buf.more():
                raise ArraySyntaxError(buf.base + pos, "the file ends inside a record")
            continue
        token = match.group()
        i = match.end()
        if token in (b"[", b"{"):
            level += 1
        elif token in (b"]", b"}"):
            level -= 1
            if level == 0:
                return i


def _scalar_end(buf: _Buffer, pos: int) -> int:
    """The index after a string, number or literal item at ``pos`` (never an object; to_record refuses it)."""
    while True:
        if buf.data[pos:pos + 1] == b'"':
            match = _SCAN.match(buf.data, pos)
            if match.group() != b'"':
                return match.end()
        else:
            match = _SCALAR_END.search(buf.data, pos)
            if match is not None:
                return match.start()
        if not buf.more():
            raise ArraySyntaxError(buf.base + pos, "the file ends inside a record")


def _open(f: IO[bytes], opening: bytes, closing: bytes, what: str) -> tuple[_Buffer, int | None]:
    """The buffer and the position of the first item after ``opening``; None for an empty array or object (the rest
    of the file checked to be space)."""
    buf = _Buffer(f)
    pos = buf.skip_space(0)
    if buf.data[pos:pos + 1] != opening:
        raise ArraySyntaxError(buf.base + pos, f"expected {opening.decode()!r}")
    pos = buf.skip_space(pos + 1)
    if buf.data[pos:pos + 1] == closing:
        _rest_is_space(buf, pos + 1, what)
        return buf, None
    return buf, pos


def _value_end(buf: _Buffer, pos: int) -> int:
    return _item_end(buf, pos) if buf.data[pos:pos + 1] in (b"{", b"[") else _scalar_end(buf, pos)


def _next(buf: _Buffer, end: int, closing: bytes, item: str, what: str) -> int | None:
    """The position of the item after the one ending at ``end``; None after the closing bracket."""
    pos = buf.skip_space(end)
    separator = buf.data[pos:pos + 1]
    if separator == closing:
        _rest_is_space(buf, pos + 1, what)
        return None
    if separator != b",":
        raise ArraySyntaxError(buf.base + pos, f"expected ',' or {closing.decode()!r} after {item}, found "
                                               f"{separator!r}")
    return buf.skip_space(pos + 1)


def iter_array_items(f: IO[bytes]) -> Iterator[bytes]:
    """The raw bytes of each item of the JSON array ``f`` holds (positioned at or before its ``[``);
    ArraySyntaxError when the array's punctuation is broken (the items before it have been yielded)."""
    buf, pos = _open(f, b"[", b"]", _ARRAY_END)
    while pos is not None:
        pos = buf.drop(pos)
        if not buf.data[pos:pos + 1] and not buf.more():
            raise ArraySyntaxError(buf.base, "the file ends inside the array")
        end = _value_end(buf, pos)
        yield buf.data[pos:end]
        pos = _next(buf, end, b"]", "a record", _ARRAY_END)


def iter_object_members(f: IO[bytes]) -> Iterator[tuple[str, bytes]]:
    """(key, the value's raw bytes) of each member of the JSON object ``f`` holds (positioned at or before its
    ``{``), streamed as ``iter_array_items`` streams an array (ActivityNet Captions: one object of videos keyed by
    id); ArraySyntaxError when the object's punctuation is broken (the members before it have been yielded)."""
    buf, pos = _open(f, b"{", b"}", _OBJECT_END)
    while pos is not None:
        pos = buf.drop(pos)
        if buf.data[pos:pos + 1] != b'"':
            raise ArraySyntaxError(buf.base + pos, "expected a key (a string)")
        end = _scalar_end(buf, pos)
        try:
            key = json.loads(buf.data[pos:end])
        except ValueError:
            raise ArraySyntaxError(buf.base + pos, "the key is not a valid JSON string") from None
        pos = buf.skip_space(end)
        if buf.data[pos:pos + 1] != b":":
            raise ArraySyntaxError(buf.base + pos, "expected ':' after a key")
        pos = buf.skip_space(pos + 1)
        if not buf.data[pos:pos + 1]:
            raise ArraySyntaxError(buf.base + pos, "the file ends inside the object")
        end = _value_end(buf, pos)
        yield key, buf.data[pos:end]
        pos = _next(buf, end, b"}", "a member", _OBJECT_END)


def _rest_is_space(buf: _Buffer, pos: int, what: str) -> None:
    pos = buf.skip_space(pos)
    if pos < len(buf.data):
        raise ArraySyntaxError(buf.base + pos, f"text after {what}")


def top_level_keys(f: IO[bytes]) -> Iterator[str]:
    """The keys of the JSON object ``f`` holds (positioned at or before its ``{``), in order, streamed: values are
    skipped by their brackets and never parsed, so COCO's ``annotations`` is found after a long ``images`` list
    (COCO's own key order) in one pass of the regex, without loading the file. Stops at the object's end."""
    buf = _Buffer(f)
    pos = buf.skip_space(0)
    if buf.data[pos:pos + 1] != b"{":
        return
    level, i = 0, pos
    while True:
        match = _SCAN.search(buf.data, i)
        if match is None or match.group() == b'"':  # a string that runs past the window: read on from its start
            i = buf.drop(match.start() if match else len(buf.data))
            if not buf.more():
                return
            continue
        token, i = match.group(), match.end()
        if token in (b"[", b"{"):
            level += 1
        elif token in (b"]", b"}"):
            level -= 1
            if level == 0:
                return
        elif level == 1:  # a string directly inside the object: a key when a colon follows it
            after = buf.skip_space(i)
            if buf.data[after:after + 1] == b":":
                yield json.loads(token)
