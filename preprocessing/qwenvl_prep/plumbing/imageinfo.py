"""Image headers (size, EXIF orientation) without decoding pixels, and baking EXIF rotation into a copy."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

from llamafactory_qwenvl_patch.image_io import jpeg
from llamafactory_qwenvl_patch.image_io.images import (
    ImageError, check_pixels, naming_warnings, open_image, require_regular_file,
)

EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class ImageInfo:
    width: int
    height: int
    orientation: int = 1

    @property
    def hw(self) -> tuple[int, int]:
        return self.height, self.width

    @property
    def displayed_hw(self) -> tuple[int, int]:
        """(h, w) as annotation tools show it, after applying the EXIF orientation."""
        return (self.width, self.height) if self.orientation in (5, 6, 7, 8) else (self.height, self.width)


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_FIRST_READ = 1 << 12
_JPEG_SCAN_BYTES = 1 << 16


def _jpeg_info(data: bytes) -> ImageInfo | None:
    """Size and EXIF orientation from a JPEG's leading bytes, walking every marker segment up to the first scan.

    PIL's JPEG open parses every table before it reports a size, which dominates ``convert``'s time; this reads
    only the SOF and APP1 segments (the EXIF payload itself is parsed by PIL). Like PIL it reads the segments before
    the first scan, wherever the EXIF sits relative to the frame header, and the first EXIF wins. None: not a plain
    case (XMP, which PIL also reads an orientation from; bytes ending before the scan), use PIL.
    """
    if data[:2] != b"\xff\xd8":
        return None
    orientation, size = None, None
    for marker, start, after in jpeg.segments(data):
        payload = data[start:after]
        if marker == jpeg.SOS:  # first scan: every header segment has been seen
            return ImageInfo(size[0], size[1], orientation or 1) if size else None
        if marker == 0xE1 and payload.startswith(b"Exif\x00\x00"):
            if orientation is None:
                try:
                    exif = Image.Exif()
                    exif.load(payload)
                    orientation = int(exif.get(EXIF_ORIENTATION, 1) or 1)
                except Exception:  # noqa: BLE001 - malformed EXIF: PIL's own reading below decides
                    return None
        elif marker == 0xE1 and (b"xap/1.0" in payload[:64] or b"xmp" in payload[:64].lower()):
            return None
        elif marker in _SOF and size is None and len(payload) >= 5:
            height, width = int.from_bytes(payload[1:3], "big"), int.from_bytes(payload[3:5], "big")
            if not (width and height):
                return None
            size = (width, height)
    return None


def read_info(path: str | os.PathLike) -> ImageInfo:
    """Header-only read of size and EXIF orientation, never decoding pixels (JPEG fast path, PIL otherwise)."""
    require_regular_file(path)
    try:
        with open(path, "rb") as f, naming_warnings(str(path)):
            head = f.read(_JPEG_FIRST_READ)
            info = _jpeg_info(head)
            if info is None and head[:2] == b"\xff\xd8" and len(head) == _JPEG_FIRST_READ:
                info = _jpeg_info(head + f.read(_JPEG_SCAN_BYTES - _JPEG_FIRST_READ))
    except OSError:
        info = None  # open_image below reports it with the image's name
    if info is not None:
        check_pixels(info.width, info.height, str(path))
        return info
    with open_image(str(path)) as image, naming_warnings(str(path)):
        try:
            orientation = int(image.getexif().get(EXIF_ORIENTATION, 1) or 1)
        except Exception:  # noqa: BLE001 - a malformed EXIF segment (struct errors, bad offsets) has no orientation
            orientation = 1
        return ImageInfo(image.width, image.height, orientation)


def bake_exif(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write a copy with the EXIF rotation applied to the pixels (orientation 1); returns its path.

    The name is a hash of the source path, so repeated runs and parallel workers reuse one copy.
    """
    src = Path(path)
    out = Path(out_dir) / f"{hashlib.sha1(str(src.resolve()).encode()).hexdigest()[:16]}{src.suffix.lower()}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with Image.open(src) as image:
            rotated = ImageOps.exif_transpose(image)
            fmt = image.format
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".bake-", suffix=src.suffix)
            os.close(fd)
            try:
                rotated.save(tmp, format=fmt, quality=95) if fmt == "JPEG" else rotated.save(tmp, format=fmt)
                os.replace(tmp, out)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"image {src}: cannot bake EXIF orientation ({exc})") from None
    return out
