"""Atomic file writes: a temp file beside the target, renamed into place only when complete."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


@contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Yield a file that replaces ``path`` on success and vanishes on any error."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | os.PathLike, data: Any) -> None:
    with atomic_writer(path) as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
