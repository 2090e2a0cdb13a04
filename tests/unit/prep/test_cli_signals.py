"""qwenvl-prep's SIGTERM and Ctrl-C are never lost: an interrupt that lands where Python ignores exceptions (an
at-fork callback such as logging's lock release, which a pool's fork runs; a ``__del__``) printed "Exception
ignored" with a traceback and the run went on (seen once in tests/cli/test_hostile_convert_signals.py under load)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

SCRIPT = """
import os, signal, sys, time
from qwenvl_prep.cli import stop_signals

signum = signal.{signal}
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a shell; a test runner's worker may ignore SIGINT


class Finaliser:
    def __del__(self):
        os.kill(os.getpid(), signum)


def interrupt_in_an_ignored_place():
    if "{where}" == "fork":
        os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signum))
        if os.fork() == 0:
            os._exit(0)
    else:
        Finaliser()


try:
    with stop_signals():
        interrupt_in_an_ignored_place()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.01)
        print("went on")
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("where", ["fork", "del"])
@pytest.mark.parametrize("name, code", [("SIGTERM", 128 + signal.SIGTERM), ("SIGINT", 130)])
def test_an_interrupt_where_exceptions_are_ignored_still_stops_the_run(where, name, code):
    """The handler's exception is swallowed there; the signal comes again and the main thread unwinds at its next
    step: the exit code of the signal, nothing printed, the loop after it never finishes."""
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(signal=name, where=where)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert done.returncode == code, done.stderr[-2000:]
    assert "went on" not in done.stdout
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_other_ignored_exceptions_are_still_reported():
    """Only the interrupts are taken over: any other exception in a ``__del__`` prints as Python prints it."""
    script = ("from qwenvl_prep.cli import stop_signals\n"
              "class Broken:\n    def __del__(self):\n        raise ValueError('from __del__')\n"
              "with stop_signals():\n    Broken()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Exception ignored" in done.stderr and "from __del__" in done.stderr


THREAD_SCRIPT = """
import os, signal, sys, threading, time
from qwenvl_prep.cli import stop_signals

signal.signal(signal.SIGINT, signal.default_int_handler)


def fail(text):
    raise RuntimeError(text)


try:
    with stop_signals():
        thread = threading.Thread(target=fail, args=("before the stop",))
        thread.start()
        thread.join()
        try:
            os.kill(os.getpid(), signal.{signal})
            time.sleep(5)
        finally:  # what a pool's result thread does when the interrupt left its lock released
            thread = threading.Thread(target=fail, args=("after the stop",))
            thread.start()
            thread.join()
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("name, code", [("SIGTERM", 128 + signal.SIGTERM), ("SIGINT", 130)])
def test_a_thread_broken_by_the_stop_prints_nothing(name, code):
    """A thread failing once an interrupt unwinds the run (a pool's result thread finding its lock released: "release
    unlocked lock") is part of the stop: no traceback. The same failure before any stop prints as Python prints it."""
    done = subprocess.run([sys.executable, "-c", THREAD_SCRIPT.format(signal=name)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == code, done.stderr[-2000:]
    assert "before the stop" in done.stderr and "after the stop" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("Traceback") == 1


def test_a_stop_caught_in_process_does_not_quiet_the_next_run():
    """A caller that catches a run's stop and runs again (main() called twice in one process) gets its threads'
    errors printed again."""
    script = ("import os, signal, threading, time\nfrom qwenvl_prep.cli import Stopped, stop_signals\n"
              "try:\n    with stop_signals():\n        os.kill(os.getpid(), signal.SIGTERM)\n        time.sleep(5)\n"
              "except Stopped:\n    pass\n"
              "def fail():\n    raise RuntimeError('in the next run')\n"
              "with stop_signals():\n    thread = threading.Thread(target=fail)\n    thread.start()\n    thread.join()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "in the next run" in done.stderr, done.stderr[-2000:]


def _sleep_forever(_):
    import time

    time.sleep(3600)


def test_an_abandoned_pool_is_gone_at_once_and_starts_no_worker():
    """``abandon_pool`` (convert's stop on an error or a signal, where ``Pool.terminate`` can wait forever): workers
    busy on a task or idle on the task queue are killed and reaped, the worker handler starts none in their place,
    and the pool's finalizer is cancelled, so exit does not run ``terminate`` after all."""
    import multiprocessing
    import time

    from qwenvl_prep.plumbing.workers import abandon_pool

    pool = multiprocessing.get_context("fork").Pool(3)
    pool.map_async(_sleep_forever, [0])  # one worker busy for an hour, two waiting for a task
    time.sleep(0.5)
    workers = list(pool._pool)
    begun = time.monotonic()
    abandon_pool(pool)
    assert time.monotonic() - begun < 10
    assert all(w.exitcode is not None for w in workers) and not pool._worker_handler.is_alive()
    assert all(w in workers for w in pool._pool) and not pool._terminate.still_active()
