"""One ``output_dir``, one run: a training run holds a lock on its ``output_dir`` for the life of its process.

Two runs started into one folder both trained: each resumed or overwrote the other's checkpoints, ``trainer_log.jsonl``
held every step twice and a GRPO run's start trimmed the other's logs. Two ``fcntl.flock`` locks, which the kernel
releases when the holding process exits, however it dies, so a killed run never leaves them held:

- on the folder itself (a descriptor of the directory): deleting ``.qwenvl_run.lock``, which users clean as a
  leftover, let a second run lock a new file and train to the end beside the first;
- on ``output_dir/.qwenvl_run.lock``, which records who holds it (pid, host, start) for the refusal, and is the lock
  other nodes see on shared storage (NFS v4 takes flock on a file as the server's lock; on a directory it stays on
  the node that took it).

Taken by one process per run (the caller decides which: global rank 0). Processes it forks (dataloader workers) close
both descriptors: a fork shares the locks, so workers outliving a killed run kept its folder locked.

A lock is on the folder's inode, not its name: a folder deleted (or moved away and replaced) while the run trains
lets a second run lock the new folder of that name. The holder checks at every step (``check_output_dir``) that its
``output_dir`` is still the folder it locked, and stops instead of writing beside the newcomer.
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
_HELD: dict[str, tuple[int, ...]] = {}  # resolved output_dir -> the descriptors holding its locks, open until exit
_LOCKED: dict[str, tuple[int, int]] = {}  # resolved output_dir -> (st_dev, st_ino) of the folder this process locked
# filesystems without locks (some FUSE mounts; EBADF: a network filesystem refusing a lock on a read-only
# descriptor, as a directory's is): that lock is skipped
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


class RunLockedError(RuntimeError):
    """Another live process is training into this ``output_dir``."""


def lock_output_dir(output_dir: str | os.PathLike) -> str | None:
    """Take ``output_dir``'s run lock for the rest of this process (again in the same process: a no-op, unless the
    folder it locked was since deleted or replaced: then the new folder is locked). Raises RunLockedError naming the
    holder; returns a warning when the filesystem has no locks (None when held)."""
    folder = Path(output_dir).resolve()
    if str(folder) in _HELD:
        if _is_locked_folder(folder):
            return None
        for descriptor in _HELD.pop(str(folder)):  # a folder gone since: its locks guard nothing
            os.close(descriptor)
        _LOCKED.pop(str(folder), None)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    held: list[int] = []
    try:
        folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        identity = os.fstat(folder_fd)
        if _flock(folder_fd, output_dir, path) is None:  # first: a refused run must not recreate a deleted file
            held.append(folder_fd)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        unlockable = _flock(fd, output_dir, path)
    except BaseException:
        for descriptor in held:
            os.close(descriptor)
        raise
    if unlockable is None:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        held.append(fd)
    if held:
        _HELD[str(folder)] = tuple(held)
        _LOCKED[str(folder)] = (identity.st_dev, identity.st_ino)
        return None
    return (f"cannot lock {path} ({unlockable}): this filesystem has no file locks, so nothing stops a second run "
            "from starting into the same output_dir; start one run per output_dir")


def check_output_dir(output_dir: str | os.PathLike) -> None:
    """Raise RunLockedError when the ``output_dir`` this process locked is no longer the folder at that path (deleted,
    or moved away and replaced); a no-op where this process holds no lock on it."""
    folder = Path(output_dir).resolve()
    if str(folder) in _LOCKED and not _is_locked_folder(folder):
        raise RunLockedError(
            f"output_dir {output_dir} was deleted or replaced while this run trained into it: its lock went with the "
            "folder, so another run may be training there now. This run stops rather than write beside it; give it "
            "its own output_dir and resume from a checkpoint you kept.")


def _is_locked_folder(folder: Path) -> bool:
    """Whether ``folder`` (resolved, locked by this process) is still the folder that was locked."""
    try:
        now = os.stat(folder)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == _LOCKED[str(folder)]


def _flock(fd: int, output_dir: str | os.PathLike, path: Path) -> str | None:
    """Lock ``fd``: None when held; the reason when the filesystem cannot lock it (``fd`` then closed). Raises
    RunLockedError naming the holder (``fd`` closed) when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        os.close(fd)
        raise RunLockedError(
            f"output_dir {output_dir} is in use by another run: {_holder(path)}. Two runs in one output_dir "
            "overwrite each other's checkpoints and logs, so this one stops before loading anything. Wait for that "
            "run to end (or stop it), or give this run another output_dir.") from None
    except OSError as exc:
        os.close(fd)
        if exc.errno in _NO_LOCKS:
            return exc.strerror or errno.errorcode.get(exc.errno, str(exc.errno))
        raise


def _holder(path: Path) -> str:
    """Who holds the lock, as its file records it."""
    try:
        record = json.loads(path.read_bytes())
        return f"pid {record['pid']} on {record['host']} (started {record['started']}) holds {path}"
    except FileNotFoundError:
        return (f"a live process holds the folder's lock (its lock file {path} was deleted, so it cannot say which; "
                "deleting it does not free the folder)")
    except (OSError, ValueError, KeyError, TypeError):
        return f"another process holds {path} (it has not written its pid yet)"


def _close_in_child() -> None:
    """In a forked child: close the run's lock descriptors (a fork shares the locks; only the run may hold them)."""
    for descriptors in _HELD.values():
        for descriptor in descriptors:
            os.close(descriptor)
    _HELD.clear()
    _LOCKED.clear()


os.register_at_fork(after_in_child=_close_in_child)
