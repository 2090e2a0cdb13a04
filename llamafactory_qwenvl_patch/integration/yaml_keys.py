"""Which keys a user really wrote: LF's dataclasses cannot tell a default from an explicit value."""

from __future__ import annotations

from typing import Any


def explicit_keys(raw_args: dict[str, Any] | list[str] | None) -> set[str]:
    """The keys a user wrote in the YAML (or as ``--key`` on the command line)."""
    if isinstance(raw_args, dict):
        return set(raw_args)
    keys = set()
    for arg in raw_args or []:
        if isinstance(arg, str) and arg.startswith("--"):
            keys.add(arg[2:].split("=", 1)[0])
        elif isinstance(arg, str) and "=" in arg:  # OmegaConf-style key=value overrides after the YAML
            keys.add(arg.split("=", 1)[0])
    return keys
