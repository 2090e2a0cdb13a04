"""Hostile input for qwenvl-prep's fast image header reader (issues 11 and 22): EXIF anywhere before the scan
reads as PIL reads it, and a JPEG whose header claims a huge size is refused as a decompression bomb."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import save_image
from hostile import RECORD, run_convert
from hypothesis import given, settings
from hypothesis import strategies as st

from llamafactory_qwenvl_patch.image_io.images import ImageError
from qwenvl_prep.plumbing.imageinfo import read_info


def _segments(data: bytes) -> tuple[list[bytes], bytes]:
    """A JPEG's header segments (after SOI, before the first scan) and the rest from the scan on."""
    segments, i = [], 2
    while data[i + 1] != 0xDA:
        length = int.from_bytes(data[i + 2:i + 4], "big")
        segments.append(data[i:i + 2 + length])
        i += 2 + length
    return segments, data[i:]


def _exif_segment(orientation: int) -> bytes:
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    payload = exif.tobytes()
    if not payload.startswith(b"Exif\x00\x00"):  # Pillow 11 leaves the header out, 10.x writes it
        payload = b"Exif\x00\x00" + payload
    return b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload


@settings(max_examples=60, deadline=None)
@given(w=st.integers(8, 2000), h=st.integers(8, 2000), orientations=st.lists(st.sampled_from([1, 3, 6, 8]),
                                                                                  max_size=2),
       position=st.integers(0, 20), data=st.data())
def test_exif_anywhere_before_the_scan_agrees_with_pil(tmp_path_factory, w, h, orientations, position, data):
    """Class 10: the fast header reader stopped at the frame header, so an EXIF segment after it (orientation 6
    for PIL) read as 1 and `--exif error` never fired. Now it agrees with PIL on every layout: EXIF before or after
    the frame header or the tables, several EXIF segments (the first wins), or XMP (handed to PIL)."""
    from PIL import Image

    from qwenvl_prep.plumbing.imageinfo import _jpeg_info, read_info

    buffer = tmp_path_factory.mktemp("exif") / "x.jpg"
    Image.new("RGB", (w, h), (10, 20, 30)).save(buffer, quality=50)
    segments, rest = _segments(buffer.read_bytes())
    extra = [_exif_segment(o) for o in orientations]
    xmp = data.draw(st.booleans())
    if xmp:
        payload = b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta><tiff:Orientation>6</tiff:Orientation></x:xmpmeta>"
        extra.append(b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload)
    for segment in extra:
        segments.insert(min(position, len(segments)), segment)
        position = data.draw(st.integers(0, len(segments)))
    buffer.write_bytes(b"\xff\xd8" + b"".join(segments) + rest)
    with Image.open(buffer) as pil:
        expected = (pil.width, pil.height, int(pil.getexif().get(0x0112, 1) or 1))
    info = read_info(buffer)
    assert (info.width, info.height, info.orientation) == expected
    fast = _jpeg_info(buffer.read_bytes())
    assert (fast is None) == xmp  # the fast path answers every plain layout itself


def _jpeg_claiming(path: Path, width: int, height: int) -> Path:
    """A small valid JPEG whose frame header claims another size."""
    from PIL import Image

    Image.new("RGB", (64, 48), (10, 20, 30)).save(path, quality=50)
    data = bytearray(path.read_bytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    path.write_bytes(bytes(data))
    return path


def test_a_jpeg_claiming_a_huge_size_is_refused_by_the_fast_path(tmp_path):
    """Item 8: a header claiming 60000x60000 passed convert's fast header read (check, draw and training refuse
    it as PIL does)."""
    bomb = _jpeg_claiming(tmp_path / "huge.jpg", 60000, 60000)
    with pytest.raises(ImageError, match="huge.jpg: refused as a decompression bomb"):
        read_info(bomb)
    save_image(tmp_path / "ok.jpg", 640, 480)
    code, out = run_convert(tmp_path, [RECORD, {**RECORD, "image": "huge.jpg"}], "--input-coords", "abs",
                            "--skip-bad")
    [row] = [json.loads(line) for line in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    assert code == 0 and row["record"] == 1 and "decompression bomb" in row["error"]
