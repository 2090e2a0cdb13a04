"""One ``output_dir``, one run: a training run holds a lock on its ``output_dir`` for the life of its process.

Two runs started into one folder both trained: each resumed or overwrote the other's checkpoints, ``trainer_log.jsonl``
held every step twice and a GRPO run's start trimmed the other's logs. The lock is ``fcntl.flock`` on
``output_dir/.qwenvl_run.lock``: the kernel releases it when the holding process exits, however it dies, so a killed
run never leaves it held. The file records who holds it (pid, host, start), which the refusal names. Taken by one
process per run (the caller decides which: global rank 0); on NFS v4 flock is the server's lock, seen by every node.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".qwenvl_run.lock"
_HELD: dict[str, int] = {}  # resolved output_dir -> the descriptor holding its lock, open until the process exits
# filesystems without locks (some FUSE mounts): the run goes on unguarded rather than not at all
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLockedError(RuntimeError):
    """Another live process is training into this ``output_dir``."""


def lock_output_dir(output_dir: str | os.PathLike) -> str | None:
    """Take ``output_dir``'s run lock for the rest of this process (again in the same process: a no-op). Raises
    RunLockedError naming the holder; returns a warning when the filesystem has no locks (None when held)."""
    folder = Path(output_dir).resolve()
    if str(folder) in _HELD:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunLockedError(
            f"output_dir {output_dir} is in use by another run: {holder} holds {path}. Two runs in one output_dir "
            "overwrite each other's checkpoints and logs, so this one stops before loading anything. Wait for that "
            "run to end (or stop it), or give this run another output_dir.") from None
    except OSError as exc:
        os.close(fd)
        if exc.errno in _NO_LOCKS:
            return (f"cannot lock {path} ({exc.strerror}): this filesystem has no file locks, so nothing stops a "
                    "second run from starting into the same output_dir; start one run per output_dir")
        raise
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    _HELD[str(folder)] = fd
    return None


def _holder(fd: int) -> str:
    """Who holds the lock, as its file records it."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return f"pid {record['pid']} on {record['host']} (started {record['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its pid yet)"
