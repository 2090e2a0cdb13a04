"""Atomic file writes: a temp file beside the target, renamed into place only when complete."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import signal
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block is done (their handlers then run as usual)."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w", follow_symlink: bool = False) -> Iterator[IO]:
    """Yield a file that replaces ``path`` on success and vanishes on any error; an existing file keeps its
    permission bits. A symlink is refused, unless ``follow_symlink`` (a shared registry): then it is written through
    (its target is replaced, the link stays a link)."""
    if os.path.islink(path) and not follow_symlink:
        raise ValueError(f"{path} is a symbolic link; qwenvl-prep does not write through links it did not create")
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a file to write")
    target.parent.mkdir(parents=True, exist_ok=True)
    keep = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o644
    remove_stale_temps(target)
    tmp = None
    try:  # entered before the temp file exists: a signal handled right after it is made still removes it
        with _signals_deferred():
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp")
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
        os.chmod(tmp, keep)
        os.replace(tmp, target)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(target: Path) -> list[Path]:
    """Delete temp files of ``target`` left by runs that were killed (``.NAME.PID.*.tmp`` whose PID is gone): a
    SIGKILL leaves no chance to clean up, so the next run does it."""
    removed = []
    for tmp in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        pid = tmp.name[len(target.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def write_json(path: str | os.PathLike, data: Any, follow_symlink: bool = False) -> None:
    with atomic_writer(path, follow_symlink=follow_symlink) as f:
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
