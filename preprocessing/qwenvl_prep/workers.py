"""What every qwenvl-prep process prints and how its worker processes end: warnings as one line, and workers that
leave interrupts to their parent and die with it (an orphan would print a BrokenPipeError traceback when it next
hands back a result)."""

from __future__ import annotations

import ctypes
import signal
import sys
import warnings
from typing import Any

_PR_SET_PDEATHSIG = 1


def one_line_warnings(prog: str) -> None:
    """Show every warning as ``PROG: warning: MESSAGE`` on one line (no source file and line of a library)."""

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        print(f"{prog}: warning: {message}", file=file or sys.stderr)

    warnings.showwarning = show


def init_worker(prog: str = "qwenvl-prep") -> None:
    """Pool initializer: Ctrl-C and SIGTERM are the parent's to handle (it stops the pool); the worker is sent
    SIGTERM when its parent dies (Linux) and dies of SIGPIPE if it hands back a result first (the two race when the
    parent is killed), and warnings stay one line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a write to a dead parent's pipe ends the worker, silently
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: an orphan ends when it finds its pipe closed
        pass
    one_line_warnings(prog)
