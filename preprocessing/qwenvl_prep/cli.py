"""``qwenvl-prep`` command line: wires the subcommands of ``commands/`` into one parser, and runs one with the
same error, interrupt and warning handling. Subcommands import their heavy modules lazily, so ``--help`` answers fast."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import warnings
from typing import Callable, Sequence

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


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if main_thread else None  # unwind: temps removed, workers stopped
    shown = warnings.showwarning
    one_line_warnings(f"qwenvl-prep {args.command}")
    try:
        return func(args)
    except (OSError, ValueError, RuntimeError) as exc:  # OSError: a folder not writable, a disk full, ...
        print(f"qwenvl-prep {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qwenvl-prep {args.command}: interrupted; nothing partial was left behind", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
