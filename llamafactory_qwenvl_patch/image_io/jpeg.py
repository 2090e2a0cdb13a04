"""Walking a JPEG's marker segments without decoding (pure): the one walker behind the fast header reader of
``qwenvl-prep`` and the structural check of the training pre-flight."""

from __future__ import annotations

from typing import Iterator

SOI, SOS, EOI = 0xD8, 0xDA, 0xD9
RST = frozenset(range(0xD0, 0xD8))
STANDALONE = RST | {0x01, SOI}


def segments(data: bytes, start: int = 2) -> Iterator[tuple[int, int, int]]:
    """(marker, offset of its payload, offset after the segment) for each segment from ``start``; standalone markers
    and fill bytes are skipped; EOI yields with an empty payload. Stops at the end of the data, at a byte that is not
    a marker, or at a segment longer than the data (a truncated header); check the last offset against ``len``."""
    i, end = start, len(data)
    while i + 2 <= end:
        if data[i] != 0xFF:
            return
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker in STANDALONE:
            i += 2
            continue
        if marker == EOI:
            yield marker, i + 2, i + 2
            return
        if i + 4 > end:
            return
        after = i + 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if after > end:
            return
        yield marker, i + 4, after
        i = after


def skip_entropy_data(data: bytes, i: int) -> int | None:
    """Offset of the marker that ends the entropy-coded data starting at ``i`` (0xFF not followed by a stuffed
    0x00 or a restart marker), or None when the data ends first (a truncated file). The search runs in C."""
    end = len(data)
    while True:
        i = data.find(b"\xff", i)
        if i < 0 or i + 1 >= end:
            return None
        if data[i + 1] == 0x00 or data[i + 1] in RST:
            i += 2
            continue
        return i


def is_complete(data: bytes) -> bool:
    """True when the marker structure is whole up to the end-of-image marker: segments walked by their lengths (so
    an end marker inside a comment does not count), each scan's data skipped to its next marker."""
    if data[:2] != b"\xff\xd8":
        return False
    i = 2
    while True:
        for marker, _, after in segments(data, i):
            if marker == EOI:
                return True
            i = after
            if marker == SOS:
                break
        else:
            return False
        i = skip_entropy_data(data, i)
        if i is None:
            return False
