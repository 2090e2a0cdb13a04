"""Model-input images kept across epochs (``qwenvl_image_cache_mb``): a run that draws each image several times
decodes and resizes it once per process instead of once per draw. The pixels are those ``model_input_image`` makes;
an entry is keyed by the file's identity (device, inode, size, modification time) and the policy, so a file replaced
or touched is read again, and inputs that are not files (bytes, PIL images) are never kept."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Callable

from PIL import Image

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.image_io.images import file_path

MAX_CACHE_MB = 1 << 20  # 1 TiB: a bound on the key, not a recommendation


class ImageCache:
    """A least-recently-used store of model-input images bounded in bytes (width x height x bands)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple, Image.Image] = OrderedDict()

    def image(self, source: Any, policy: ResizePolicy, make: Callable[[Any, ResizePolicy], Image.Image]
              ) -> Image.Image:
        """``make(source, policy)``, from the store when the same file was made under the same policy; a copy, so
        the caller may change it without touching the stored one."""
        key = _file_key(source, policy) if self.max_bytes > 0 else None
        if key is None:
            return make(source, policy)
        stored = self._entries.get(key)
        if stored is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return stored.copy()
        self.misses += 1
        image = make(source, policy)
        size = _nbytes(image)
        if size <= self.max_bytes:
            self._entries[key] = image.copy()
            self.used += size
            while self.used > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.used -= _nbytes(evicted)
        return image


def _nbytes(image: Image.Image) -> int:
    return image.width * image.height * len(image.getbands())


def _file_key(source: Any, policy: ResizePolicy) -> tuple | None:
    """The identity of the file an input names (``images.file_path``) under ``policy``, or None."""
    path = file_path(source)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None  # the maker names what is wrong
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, policy.min_pixels, policy.max_pixels, policy.factor)


_CACHES: dict[int, ImageCache] = {}


def process_cache(max_mb: int) -> ImageCache:
    """This process's store of ``max_mb`` megabytes (one per size asked for; a dataloader worker has its own)."""
    if max_mb not in _CACHES:
        _CACHES[max_mb] = ImageCache(max_mb * (1 << 20))
    return _CACHES[max_mb]
