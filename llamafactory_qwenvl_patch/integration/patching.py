"""What every LLaMA-Factory patch uses: wrap an LF function once and rebind the names LF modules already imported
(LF modules, and transformers', bind each other's functions with ``from ... import``, so replacing one attribute is
not enough), and ask whether a distribution is installed."""

from __future__ import annotations

import functools
import sys
from importlib import metadata
from types import ModuleType
from typing import Any, Callable


def _replace(module: ModuleType, name: str, make: Callable[[Callable], Callable]) -> None:
    """Wrap ``module.name`` once, and rebind every LF module that already imported the original."""
    original = getattr(module, name)
    if getattr(original, "__qwenvl_wrapped__", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper.__qwenvl_wrapped__ = True
    _rebind(original, wrapper)


def _rebind(original: Any, new: Any, package: str = "llamafactory") -> None:
    """Point every already-loaded module name of ``package`` bound to ``original`` at ``new`` (later imports get
    ``new``)."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is not None and (mod_name == package or mod_name.startswith(package + ".")):
            for attr, value in list(vars(mod).items()):
                if value is original:
                    setattr(mod, attr, new)


def _installed(distribution: str) -> bool:
    """Whether a distribution is installed, by the name pip knows it under (not its import name)."""
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True
