"""Opening images and producing the exact model-input image, with errors that name the image."""

from __future__ import annotations

import os
import stat
import warnings
from contextlib import contextmanager
from io import BytesIO
from typing import Any, Iterator

from PIL import Image, UnidentifiedImageError

from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy


class ImageError(ValueError):
    """An image that cannot be used; the message names it and says what is wrong."""


class ImageWarning(UserWarning):
    """Something PIL noticed about an image that can still be used, with the image's name."""


@contextmanager
def naming_warnings(name: str) -> Iterator[None]:
    """PIL's warnings inside the block (corrupt EXIF, palette transparency, a large image, ...) come out as one
    ``ImageWarning`` naming the image, instead of PIL's own anonymous warning with a source line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        if f"{os.sep}PIL{os.sep}" in warning.filename:
            warnings.warn(ImageWarning(f"image {name}: {warning.message}"), stacklevel=3)
        else:  # not about this image (a file closed by the garbage collector meanwhile, ...): as it was
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def describe(source: Any) -> str:
    """A short human name for an LF image input (path, bytes, dict or PIL image)."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    if isinstance(source, dict):
        return str(source.get("path") or f"<{len(source.get('bytes') or b'')} bytes>")
    if isinstance(source, bytes):
        return f"<{len(source)} bytes>"
    if isinstance(source, Image.Image):
        return getattr(source, "filename", "") or f"<in-memory {source.mode} image {source.width}x{source.height}>"
    return f"<{type(source).__name__}>"


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is (``a FIFO``, ``a socket``, ...), from its ``st_mode``."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def require_regular_file(path: str | os.PathLike, kind: str = "image") -> None:
    """Only regular files are read: opening a FIFO or a device would block forever (or read without end). ``kind``
    names what the file is (an ``image``, a ``video``)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ImageError(f"{kind} {path}: file not found") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ImageError(f"{kind} {path!r}: cannot open ({exc})") from None
    if not stat.S_ISREG(mode):
        raise ImageError(f"{kind} {path}: is {file_kind(mode)}, not a regular file; only regular {kind} files are "
                         "read")


def check_pixels(width: int, height: int, name: str, kind: str = "image") -> None:
    """PIL's decompression-bomb rule for a size read from a header without PIL (more than twice
    ``Image.MAX_IMAGE_PIXELS`` is refused), so a fast header read refuses what opening the image would; ``kind``
    names what the size is of (a ``video``'s frames)."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > 2 * limit:
        raise ImageError(f"{kind} {name}: refused as a decompression bomb ({width}x{height} = {width * height} "
                         f"pixels, over twice PIL's limit of {limit})")


def open_image(source: Any) -> Image.Image:
    """Open (lazily, header only) any image input LLaMA-Factory accepts."""
    name = describe(source)
    with naming_warnings(name):
        return _open(source, name)


def file_path(source: Any) -> str | os.PathLike | None:
    """The file an LF image input names (a path, a ``file://`` URL, or ``{"path": ...}`` without bytes), or None."""
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            return None
        source = source.get("path")
    if isinstance(source, str) and source.startswith("file://"):
        source = source[len("file://"):]
    return source if isinstance(source, (str, os.PathLike)) else None


def _open(source: Any, name: str) -> Image.Image:
    try:
        if isinstance(source, Image.Image):
            return source
        path = file_path(source)
        if path is not None:
            require_regular_file(path)
            return Image.open(path)
        if isinstance(source, dict):
            source = source["bytes"] if source.get("bytes") is not None else source["path"]
        if isinstance(source, bytes):
            return Image.open(BytesIO(source))
        return Image.open(source)
    except FileNotFoundError:
        raise ImageError(f"image {name}: file not found") from None
    except UnidentifiedImageError:
        raise ImageError(f"image {name}: not a readable image file") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image {name}: refused as a decompression bomb ({exc})") from None
    except (OSError, KeyError, TypeError) as exc:
        raise ImageError(f"image {name}: cannot open ({exc})") from None


_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def decode(image: Image.Image, name: str) -> Image.Image:
    """Decode all pixels now, so a truncated or corrupt file fails here with its name, not deep in PIL later.
    16-bit grey images (PIL modes ``I;16`` / ``I``) come back as 8-bit ``L`` scaled by 1/257: PIL's own RGB
    conversion clips them, and a 16-bit PNG would train as a near-white image."""
    try:
        with naming_warnings(name):
            image.load()
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image {name}: refused as a decompression bomb ({exc})") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"image {name}: cannot decode pixels ({exc}); the file is truncated or corrupt") from None
    if image.mode in _WIDE_MODES:
        import numpy as np

        values = np.asarray(image, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8))
    return image


def _model_size(image: Image.Image, policy: ResizePolicy, name: str) -> tuple[int, int]:
    try:
        return policy.model_size(image.height, image.width)
    except PolicyError as exc:
        raise ImageError(f"image {name}: {exc}") from None


def model_input_size(source: Any, policy: ResizePolicy) -> tuple[int, int]:
    """(height, width) of the image ``model_input_image`` makes, from the header alone: counting an image's tokens
    (LF's tokenization of a whole dataset) then decodes nothing."""
    image = open_image(source)
    try:
        return _model_size(image, policy, describe(source))
    finally:
        if image is not source and not hasattr(source, "read"):  # a caller's stream stays open for its pixels
            image.close()


def model_input_image(source: Any, policy: ResizePolicy) -> Image.Image:
    """The RGB image the vision encoder sees: ``qwen_vl_utils.fetch_image`` with the policy's pinned bounds."""
    from qwen_vl_utils import fetch_image

    name = describe(source)
    image = decode(open_image(source), name)
    expected = _model_size(image, policy, name)
    out = fetch_image(
        {"image": image, "min_pixels": policy.min_pixels, "max_pixels": policy.max_pixels},
        image_patch_size=policy.patch_size,
    )
    if (out.height, out.width) != expected:
        raise RuntimeError(
            f"qwen_vl_utils.fetch_image returned {out.width}x{out.height} for {name}, the policy says "
            f"{expected[1]}x{expected[0]}: the installed qwen-vl-utils changed its resize rule"
        )
    return out


BLANK_GREY = (128, 128, 128)


def blank_like(source: Any) -> Image.Image:
    """A uniform grey RGB image of the stored size of ``source``: the same resize, frame and image-token count,
    with nothing to see (the image-reliance control of GRPO)."""
    with open_image(source) as image:
        size = image.size
    return Image.new("RGB", size, BLANK_GREY)
