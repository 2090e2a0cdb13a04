"""Atomic file writes: a temp file beside the target, renamed into place only when complete."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


@contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Yield a file that replaces ``path`` on success and vanishes on any error. A symlink is written through (its
    target is replaced, the link stays a link) and an existing file keeps its permission bits."""
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a file to write")
    target.parent.mkdir(parents=True, exist_ok=True)
    keep = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
        os.chmod(tmp, keep)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | os.PathLike, data: Any) -> None:
    with atomic_writer(path) as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


@contextmanager
def exclusive(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock tied to ``path`` (a hidden ``.NAME.lock`` beside it) across processes and threads, so
    read-modify-rename updates of a shared file (``dataset_info.json`` under parallel shard converts) lose nothing."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
