"""The training-start image check: cheap for good files, exact for truncated ones."""

from __future__ import annotations

import pytest
from helpers import save_image

from llamafactory_qwenvl_patch.image_io.images import ImageError
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.integration.preflight import check_image

POLICY = ResizePolicy(256 * 28 * 28, 1024 * 28 * 28)


def test_truncated_jpeg_caught_trailer_accepted(tmp_path):
    good = save_image(tmp_path / "good.jpg", 1200, 900, (10, 120, 30))
    data = good.read_bytes()
    trailer = tmp_path / "trailer.jpg"
    trailer.write_bytes(data + b"\x00" * 10000)  # vendor data after the end marker: still a valid image
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(data[: len(data) // 2])
    check_image(str(good), POLICY)
    check_image(str(trailer), POLICY)
    check_image({"bytes": data, "path": None}, POLICY)
    with pytest.raises(ImageError, match="truncated.jpg: .*truncated"):
        check_image(str(truncated), POLICY)


def test_png_corruption_and_missing(tmp_path):
    png = save_image(tmp_path / "a.png", 300, 200)
    broken = tmp_path / "broken.png"
    raw = bytearray(png.read_bytes())
    raw[60] ^= 0xFF  # flip a byte inside the image data: the chunk CRC no longer matches
    broken.write_bytes(bytes(raw))
    check_image(str(png), POLICY)
    with pytest.raises(ImageError, match="broken.png"):
        check_image(str(broken), POLICY)
    with pytest.raises(ImageError, match="file not found"):
        check_image(str(tmp_path / "nope.png"), POLICY)
