"""``qwenvl-prep`` command line: wires the subcommands of ``commands/`` into one parser, and runs one with the
same error, interrupt and warning handling. Subcommands import their heavy modules lazily, so ``--help`` answers fast."""

from __future__ import annotations

import _thread
import argparse
import os
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator, Sequence

# Pillow imports numpy, whose OpenBLAS starts a thread per core at import: the CLI would no longer be single-threaded
# and convert's pool would use forkserver instead of fork (slower to start, and a worker still starting when a run is
# stopped printed a FileNotFoundError traceback). qwenvl-prep's numpy work is elementwise: one BLAS thread loses
# nothing. Set before the imports below.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from qwenvl_prep.commands import COMMANDS  # noqa: E402
from qwenvl_prep.plumbing.workers import one_line_warnings  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwenvl-prep",
        description="Convert, check, draw and evaluate Qwen-VL grounding datasets in exactly the frame the model "
        "sees, under the same resize policy as `llamafactory-cli train` with `qwenvl_patch: true`.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


class Stopped(SystemExit):
    """SIGTERM, raised where the main thread is: the run unwinds (temps removed, workers stopped) and exits 143."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


_STOPPING = threading.Event()  # set once an interrupt unwinds the main thread


def _stop(signum: int, frame: object) -> None:
    _STOPPING.set()
    raise Stopped(signum)


def _interrupt(signum: int, frame: object) -> None:
    _STOPPING.set()
    raise KeyboardInterrupt


def _quiet_after_stop(args: threading.ExceptHookArgs, fallback: Callable) -> None:
    """An interrupt raised in the main thread while it waits in a pool (a ``Condition`` left released that a
    pool's result thread holds) makes that thread fail too ("release unlocked lock", seen once in
    tests/cli/test_hostile_convert_signals.py under load): a consequence of the stop, which the run is already
    unwinding from, not a second error. Before any stop, a thread's exception prints as Python prints it."""
    if not _STOPPING.is_set():
        fallback(args)


def _redeliver(unraisable: sys.UnraisableHookArgs, fallback: Callable) -> None:
    """An interrupt raised where Python ignores exceptions (an at-fork callback such as logging's lock release, a
    ``__del__``) would print "Exception ignored" with a traceback and be lost: the run went on. Send the signal
    again from another thread instead, so the main thread takes it once this hook has returned (a raw thread: a
    ``Thread.start`` waits, and the signal would land in the hook), at its next step, where it can unwind; where
    that step is ignored too, this runs again."""
    exc = unraisable.exc_value
    signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None
    if signum is None:
        fallback(unraisable)
        return
    _thread.start_new_thread(_send_later, (os.getpid(), signum))


def _send_later(pid: int, signum: int) -> None:
    time.sleep(0.05)
    os.kill(pid, signum)


@contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, neither is lost in a place where Python ignores exceptions, and what the stop
    breaks in a pool's own threads prints nothing. Main thread only (a caller's own thread keeps its process's
    handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOPPING.clear()  # a run caught its last stop and goes on: its threads' errors print again
    previous, hook, thread_hook = signal.signal(signal.SIGTERM, _stop), sys.unraisablehook, threading.excepthook
    ctrl_c = signal.getsignal(signal.SIGINT)
    if ctrl_c is signal.default_int_handler:  # left alone where SIGINT is ignored or the caller handles it
        signal.signal(signal.SIGINT, _interrupt)
    sys.unraisablehook = partial(_redeliver, fallback=hook)
    threading.excepthook = partial(_quiet_after_stop, fallback=thread_hook)
    try:
        yield
    finally:
        sys.unraisablehook, threading.excepthook = hook, thread_hook
        signal.signal(signal.SIGTERM, previous)
        if ctrl_c is signal.default_int_handler:
            signal.signal(signal.SIGINT, ctrl_c)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    shown = warnings.showwarning
    one_line_warnings(f"qwenvl-prep {args.command}")
    try:
        with stop_signals():
            return func(args)
    except (OSError, ValueError, RuntimeError) as exc:  # OSError: a folder not writable, a disk full, ...
        print(f"qwenvl-prep {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qwenvl-prep {args.command}: interrupted; nothing partial was left behind", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
