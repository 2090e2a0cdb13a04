"""Image headers (size, EXIF orientation) without decoding pixels, and baking EXIF rotation into a copy."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

from llamafactory_qwenvl_patch.images import ImageError, open_image

EXIF_ORIENTATION = 0x0112
ImageInfoError = ImageError


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


def read_info(path: str | os.PathLike) -> ImageInfo:
    """Header-only read: PIL parses the header lazily and reads EXIF without touching pixel data."""
    with open_image(str(path)) as image:
        try:
            orientation = int(image.getexif().get(EXIF_ORIENTATION, 1) or 1)
        except (OSError, SyntaxError, ValueError):
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
        raise ImageInfoError(f"image {src}: cannot bake EXIF orientation ({exc})") from None
    return out
