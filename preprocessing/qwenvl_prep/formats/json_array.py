"""The items of a top-level JSON array as their raw text, streamed.

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
_SCALAR_END = re.compile(rb"[,\]\s]")
CHUNK = 1 << 20


class ArraySyntaxError(ValueError):
    """The array's own punctuation is broken at ``offset``; nothing after it can be read."""

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
        """Forget everything before ``upto``; returns the new index of that byte (0)."""
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


def iter_array_items(f: IO[bytes]) -> Iterator[bytes]:
    """The raw bytes of each item of the JSON array ``f`` holds (positioned at or before its ``[``);
    ArraySyntaxError when the array's punctuation is broken (the items before it have been yielded)."""
    buf = _Buffer(f)
    pos = buf.skip_space(0)
    if buf.data[pos:pos + 1] != b"[":
        raise ArraySyntaxError(buf.base + pos, "expected '['")
    pos = buf.skip_space(pos + 1)
    if buf.data[pos:pos + 1] == b"]":
        return _rest_is_space(buf, pos + 1)
    while True:
        pos = buf.drop(pos)
        if not buf.data[pos:pos + 1] and not buf.more():
            raise ArraySyntaxError(buf.base, "the file ends inside the array")
        end = _item_end(buf, pos) if buf.data[pos:pos + 1] in (b"{", b"[") else _scalar_end(buf, pos)
        yield buf.data[pos:end]
        pos = buf.skip_space(end)
        separator = buf.data[pos:pos + 1]
        if separator == b"]":
            return _rest_is_space(buf, pos + 1)
        if separator != b",":
            raise ArraySyntaxError(buf.base + pos, f"expected ',' or ']' after a record, found {separator!r}")
        pos = buf.skip_space(pos + 1)


def _rest_is_space(buf: _Buffer, pos: int) -> None:
    pos = buf.skip_space(pos)
    if pos < len(buf.data):
        raise ArraySyntaxError(buf.base + pos, "text after the array's closing ']'")


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
