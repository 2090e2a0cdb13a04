"""Guarded access to LLaMA-Factory internals: if a name we patch moved, fail loudly naming the LF version."""

from __future__ import annotations

import importlib
from types import ModuleType

TESTED_LF_VERSIONS = ("0.9.5",)


def lf_version() -> str:
    try:
        from importlib.metadata import version

        return version("llamafactory")
    except Exception:  # noqa: BLE001 - any failure means we cannot tell
        return "unknown"


class LFCompatError(RuntimeError):
    """LLaMA-Factory's internals differ from what this plugin was built against."""


def require(module: ModuleType, names: list[str]) -> ModuleType:
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise LFCompatError(
            f"llamafactory-qwenvl-patch cannot patch llamafactory {lf_version()}: {module.__name__} has no "
            f"{', '.join(missing)} (tested with llamafactory {', '.join(TESTED_LF_VERSIONS)}). "
            f"Install a tested version or set QWENVL_PATCH_DISABLE=1 to run stock LLaMA-Factory."
        )
    return module


def require_module(name: str, names: list[str]) -> ModuleType:
    return require(importlib.import_module(name), names)
