"""Keep every Qwen-VL processor's bounds its own.

transformers' Qwen2-VL image and video processors (4.57 and 5.x; Qwen2.5-VL and Qwen3-VL reuse them) start from
the class-level ``size`` dict when no ``size`` is given, and then write ``min_pixels`` / ``max_pixels`` into it
(``size = self.size if size is None else size; size["shortest_edge"] = min_pixels``). A folder whose processor
config names only those two keys therefore changes the default of every processor built later in the process: a
pinned processor built next resizes in another frame. ``keep_processor_class_sizes`` gives each such ``__init__``
a copy of the class dict instead; a release whose ``__init__`` no longer has that line is left as it is.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

# (module under transformers.models, class) that have, in some tested release, the shared-dict line
CLASSES = (
    ("qwen2_vl.image_processing_qwen2_vl", "Qwen2VLImageProcessor"),
    ("qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
    ("qwen2_vl.image_processing_qwen2_vl_fast", "Qwen2VLImageProcessorFast"),
    ("qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor"),
)
SHARED_DICT_LINE = "size = self.size if size is None else size"
_MARK = "_qwenvl_own_size"


def keep_processor_class_sizes() -> list[str]:
    """Install the copy on every class of ``CLASSES`` that this transformers has with the shared-dict line; the
    names of the classes guarded (idempotent: a second call guards nothing new and returns the same names)."""
    guarded = []
    for module_name, class_name in CLASSES:
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{module_name}"), class_name)
        except (ImportError, AttributeError):  # not in this release (the _fast / _pil split moved in 5.0)
            continue
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        if not getattr(init, _MARK, False):
            try:
                source = inspect.getsource(init)
            except (OSError, TypeError):
                continue
            if SHARED_DICT_LINE not in source:
                continue
            cls.__init__ = _own_size(init)
        if cls.__name__ not in guarded:  # 5.x keeps the _fast name as an alias of the one class
            guarded.append(cls.__name__)
    return guarded


def _own_size(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("size") is None:
            kwargs["size"] = dict(type(self).size)
        init(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    return __init__
