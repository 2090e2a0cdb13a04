"""What every qwenvl-prep process prints and how its worker processes end: warnings as one line, and workers that
leave interrupts to their parent and die with it (an orphan would print a BrokenPipeError traceback when it next
hands back a result, or wait forever on a task queue whose write end it holds itself)."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import warnings
from multiprocessing.pool import TERMINATE
from typing import Any

_PR_SET_PDEATHSIG = 1


def one_line_warnings(prog: str) -> None:
    """Show every warning as ``PROG: warning: MESSAGE`` on one line (no source file and line of a library)."""

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        print(f"{prog}: warning: {message}", file=file or sys.stderr)

    warnings.showwarning = show


def init_worker(prog: str, parent_pid: int) -> None:
    """Pool initializer: Ctrl-C and SIGTERM are the parent's to handle (it stops the pool), the worker ends when
    ``parent_pid`` (the process that made the pool) ends, and dies of SIGPIPE if it hands back a result first (the
    two race when the parent is killed); warnings stay one line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a write to a dead parent's pipe ends the worker, silently
    _die_with(parent_pid)
    one_line_warnings(prog)


def _die_with(parent_pid: int) -> None:
    """SIGTERM this worker when ``parent_pid`` ends. A forkserver worker is the forkserver's child, and the
    forkserver waits for its workers, so the kernel's parent-death signal never fires there: a pidfd (Linux 5.3)
    watches the real parent under both start methods, and also sees a parent that died before this worker started."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (OSError, AttributeError):  # no pidfd: the parent-death signal covers fork workers on older Linux
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # not Linux: an orphan ends when it finds its pipe closed
            pass
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="qwenvl-prep-parent-watch", daemon=True).start()


def abandon_pool(pool: Any) -> None:
    """Stop a ``multiprocessing.Pool`` that a run leaves on an error or a signal, without ``Pool.terminate``, which
    can wait forever: it takes the task queue's read lock, which an idle worker waiting for a task holds, and it joins
    its task handler after sending the workers SIGTERM, while a worker that died writing a result holds the result
    queue's lock, so the handler never puts its last message (issue 33's stress test, once in a few hundred stops).
    The worker handler is stopped first (else it starts new workers for the killed ones), then the workers are killed
    and reaped, and the pool's own finalizer (``terminate``, also run at exit) is cancelled; the task and result
    handler threads are daemons: they end with the process (a process that goes on keeps them, idle)."""
    names = ("_pool", "_terminate", "_worker_handler", "_change_notifier", "_state")
    if not all(hasattr(pool, name) for name in names) or not callable(getattr(pool._terminate, "cancel", None)):
        pool.terminate()  # another Python's Pool: its own stop, with its own risk
        return
    pool._terminate.cancel()
    pool._state = TERMINATE
    pool._worker_handler._state = TERMINATE
    pool._change_notifier.put(None)  # wakes the worker handler, which then ends without starting a worker
    pool._worker_handler.join(timeout=10)
    for process in list(pool._pool):
        if process.exitcode is None:
            process.kill()
    for process in list(pool._pool):
        process.join(timeout=10)
