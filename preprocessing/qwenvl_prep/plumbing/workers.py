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
