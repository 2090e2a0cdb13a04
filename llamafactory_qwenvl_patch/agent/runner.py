"""Environments at the trainer's boundary: one instance per trajectory, every call timed, every failure a named end.

``EnvRunner`` is one slot: it hosts the instance of one trajectory at a time (``reset`` makes it, ``close`` ends
it) and is reused for the next. Isolation:

- ``process`` (default): the instance lives in a worker process (multiprocessing's ``forkserver`` context, ``spawn``
  where there is none; the class is loaded there). A call that does not answer within ``timeout`` seconds is killed
  with its worker (``env_timeout``); a worker that dies is an ``env_error``; the next ``reset`` starts a new worker.
- ``inline``: the instance lives in this process and each call runs in a thread, for pure-Python simulators. A hung
  call cannot be stopped: at the timeout it is left running and the instance is never called again.

Each call gives an ``Outcome``: ``ok`` with the Observation or Step, or ``env_error`` / ``env_timeout`` with a message
naming the environment, the task, the seed and the call (and the environment's first traceback, when it raised).
``start_all``, ``reset_all``, ``step_all`` and ``close_all`` start a call on every runner, then wait for each until its own
deadline, so many environments step in parallel and the slowest bounds the wait.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from llamafactory_qwenvl_patch.agent.loading import EnvLoadError, load_env_class
from llamafactory_qwenvl_patch.agent.types import Action
from llamafactory_qwenvl_patch.agent.worker import EnvHost, Reply, serve
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy

OK, ENV_ERROR, ENV_TIMEOUT = "ok", "env_error", "env_timeout"
ISOLATIONS = ("process", "inline")
# the longest wait both isolations take: a thread join (threading.TIMEOUT_MAX) and a pipe poll (its selector counts
# milliseconds in a C int: 24.8 days)
MAX_TIMEOUT_S = min(threading.TIMEOUT_MAX, (2**31 - 1) / 1000)
KILL_GRACE_S = 1.0  # a killed or shut-down worker gets this long to exit after SIGTERM before SIGKILL
TASK_NAME_CHARS = 80


@dataclass(frozen=True)
class Outcome:
    """The result of one call: ``status`` ``ok`` (``value`` is the Observation of ``reset``, the Step of ``step``,
    None for ``close``) or the end of the trajectory, ``env_error`` or ``env_timeout``, with ``message`` saying why
    and ``traceback`` the environment's own when it raised."""

    status: str
    value: Any = None
    message: str = ""
    traceback: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == OK


def describe_task(task: Any) -> str:
    """A short name for a task in messages: its ``id`` or ``name``, else its JSON text, shortened."""
    if isinstance(task, dict):
        for key in ("id", "name"):
            if isinstance(task.get(key), (str, int)) and not isinstance(task.get(key), bool):
                return repr(task[key])
    text = json.dumps(task, sort_keys=True, default=str)
    return text if len(text) <= TASK_NAME_CHARS else text[:TASK_NAME_CHARS - 3] + "..."


class _InlineChannel:
    """Calls in a thread of this process."""

    def __init__(self, host: EnvHost) -> None:
        self.host = host
        self.thread: threading.Thread | None = None
        self.reply: Reply | None = None

    def send(self, message: tuple) -> None:
        def run() -> None:
            self.reply = self.host.perform(*message)

        self.reply = None
        self.thread = threading.Thread(target=run, name="qwenvl-env-inline", daemon=True)
        self.thread.start()

    def receive(self, timeout: float) -> Reply | None:
        self.thread.join(timeout)
        return None if self.thread.is_alive() else self.reply

    def end(self) -> None:
        """Nothing can stop a thread: a hung call is left to itself."""


def _context() -> Any:
    """forkserver: a clean process forked from a server that never touched the trainer's threads or CUDA, with this
    module's worker preloaded (and the main module, as by default) so that each worker starts in milliseconds."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", serve.__module__])
    return context


def _exit_description(code: int | None) -> str:
    if code is None:
        return "it did not exit"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _ProcessChannel:
    """Calls in a worker process over a pipe."""

    def __init__(self, spec: str, kwargs: dict[str, Any], policy: ResizePolicy) -> None:
        context = _context()
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, spec, kwargs, policy), name="qwenvl-env",
                                       daemon=True)
        self.process.start()
        child.close()

    def send(self, message: tuple) -> Reply | None:
        """None when sent; a ``died`` reply when the worker is gone."""
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            return "died", self._exit()
        return None

    def receive(self, timeout: float) -> Reply | None:
        if not self.conn.poll(timeout):
            return None
        try:
            return self.conn.recv()
        except (EOFError, ConnectionError, OSError):
            return "died", self._exit()
        except Exception as exc:  # noqa: BLE001 - unpickling the environment's value: a class only its worker has
            return "error", f"answered with a value the trainer's process cannot read: {type(exc).__name__}: {exc}", None

    def _exit(self) -> str:
        self.process.join(KILL_GRACE_S)
        return _exit_description(self.process.exitcode)

    def end(self) -> None:
        """Stop the worker: SIGTERM, then SIGKILL after the grace."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(KILL_GRACE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(KILL_GRACE_S)
        self.conn.close()

    def shutdown(self) -> None:
        try:
            self.conn.send(("shutdown",))
        except (BrokenPipeError, ConnectionError, OSError):
            pass
        self.process.join(KILL_GRACE_S)
        self.end()


@dataclass
class _Pending:
    call: str  # "reset", "step 3", "close"
    started: float
    deadline: float
    reply: Reply | None = None  # known before waiting (the worker was gone when the call was sent)
    starting: bool = False  # a new worker must first say it loaded the class (within start_timeout)
    note: str = ""  # the message of an outcome known at once


class EnvRunner:
    """One environment slot (see the module's docstring). ``spec`` names the class (``module:Class`` or
    ``path/to/env.py:Class``), ``kwargs`` its constructor's keyword arguments, ``policy`` the run's frame (every
    screenshot is checked against it where the environment runs), ``timeout`` the seconds each reset, step and close
    may take; a new worker gets ``start_timeout`` to start and load the class before its first reset's timeout
    starts. EnvLoadError (a named error, not an outcome) when the class cannot be loaded: inline at construction, in
    a worker at the first reset."""

    def __init__(self, spec: str, kwargs: dict[str, Any] | None = None, *, policy: ResizePolicy,
                 isolation: str = "process", timeout: float = 60.0, start_timeout: float = 60.0) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation {isolation!r} is not one of {', '.join(ISOLATIONS)}")
        for name, value in (("timeout", timeout), ("start_timeout", start_timeout)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
                raise ValueError(f"{name} must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, got "
                                 f"{value!r}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"env {spec!r}: its keyword arguments must be a dict, got {type(kwargs).__name__}")
        self.spec, self.kwargs, self.policy = spec, dict(kwargs or {}), policy
        self.isolation, self.timeout, self.start_timeout = isolation, float(timeout), float(start_timeout)
        self._env_class = load_env_class(spec) if isolation == "inline" else None
        self._channel: _InlineChannel | _ProcessChannel | None = None
        self._pending: _Pending | None = None
        self._live = False  # an instance exists that close() has not ended
        self._task, self._seed, self._turn = "", 0, 0

    def _where(self, call: str) -> str:
        if not self._task:  # before the first reset
            return f"env {self.spec}, {call}"
        return f"env {self.spec}, task {self._task} (seed {self._seed}), {call}"

    def _idle(self, call: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{self._where(call)}: the call {self._pending.call} is still in flight; take its "
                               "result() first")

    def _begin(self, call: str, message: tuple, starting: bool = False) -> None:
        self._idle(call)
        now = time.monotonic()
        self._pending = _Pending(call, now, now + self.timeout, starting=starting)
        self._pending.reply = self._channel.send(message)

    def begin_start(self) -> None:
        """Start the worker now (process isolation; inline has nothing to start), so that a class that cannot load
        fails before any trajectory and the start is not paid inside the first rollout."""
        self._idle("start")
        now = time.monotonic()
        if self._channel is None and self.isolation == "process":
            self._channel = _ProcessChannel(self.spec, self.kwargs, self.policy)
            self._pending = _Pending("start", now, now, starting=True)
        else:
            self._pending = _Pending("start", now, now, ("ok", None))

    def begin_reset(self, task: dict, seed: int, name: str | None = None) -> None:
        """Start a trajectory: a new instance and its ``reset(task, seed)``. ``name`` names the task in messages
        (default: its ``id`` or ``name``, else its JSON)."""
        if self._live:
            raise RuntimeError(f"{self._where('reset')}: the previous trajectory is not closed; close() first")
        self._task, self._seed, self._turn = name or describe_task(task), seed, 1
        starting = self._channel is None and self.isolation == "process"
        if self._channel is None:
            self._channel = (_ProcessChannel(self.spec, self.kwargs, self.policy) if starting else
                             _InlineChannel(EnvHost(self._env_class, self.kwargs, self.policy)))
        self._live = True
        self._begin("reset", ("reset", task, seed), starting)

    def begin_step(self, action: Action) -> None:
        """Send the action of the current turn (its point in pixels of the screenshot shown on it)."""
        if not self._live:
            raise RuntimeError(f"{self._where('step')}: no trajectory in progress (reset first; after a timeout or "
                               "a crash the instance is gone)")
        self._turn += 1
        self._begin(f"step {self._turn - 1}", ("step", action, self._turn))

    def begin_close(self) -> None:
        """End the trajectory's instance (its ``close()``, timed). After a timeout or a crash there is nothing left
        to close and the result is ``ok`` at once, saying so."""
        if self._live:
            self._begin("close", ("close",))
        else:
            self._idle("close")
            now = time.monotonic()
            self._pending = _Pending("close", now, now, ("ok", None), note="nothing to close: the instance ended "
                                     "with its call's timeout or its worker's death")

    def result(self) -> Outcome:
        """Wait for the call in flight until its deadline and say how it ended."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError(f"env {self.spec}: no call in flight")
        where = self._where(pending.call)
        if pending.starting and pending.reply is None:
            started = self._started(pending, where)
            if started is not None:
                return started
            if pending.call == "start":
                return Outcome(OK, seconds=time.monotonic() - pending.started)
        reply = pending.reply
        if reply is None:
            reply = self._channel.receive(max(0.0, pending.deadline - time.monotonic()))
        seconds = time.monotonic() - pending.started
        if reply is None:
            stopped = ("its worker process was killed" if self.isolation == "process" else
                       "inline isolation cannot stop it: the call is left running in its thread and the instance is "
                       "never called again")
            self._lose()
            return Outcome(ENV_TIMEOUT, message=f"{where}: no answer within {self.timeout:g} s; {stopped}",
                           seconds=seconds)
        kind = reply[0]
        if kind == "died":
            self._lose()
            return Outcome(ENV_ERROR, message=f"{where}: its worker process died ({reply[1]})", seconds=seconds)
        if pending.call == "close":
            self._live = False
        if kind == "ok":
            return Outcome(OK, reply[1], message=pending.note, seconds=seconds)
        return Outcome(ENV_ERROR, message=f"{where}: {reply[1]}", traceback=reply[2], seconds=seconds)

    def _started(self, pending: _Pending, where: str) -> Outcome | None:
        """Wait for a new worker to load the class; its first call's timeout starts when it has (``ready``)."""
        said = self._channel.receive(max(0.0, pending.started + self.start_timeout - time.monotonic()))
        if said is not None and said[0] == "ready":
            pending.deadline = said[1] + self.timeout
            return None
        self._lose()
        if said is None:
            return Outcome(ENV_TIMEOUT, message=f"{where}: its worker did not start and load the class within "
                           f"{self.start_timeout:g} s; it was killed", seconds=time.monotonic() - pending.started)
        if said[0] == "load_error":
            raise EnvLoadError(said[1])
        return Outcome(ENV_ERROR, message=f"{where}: its worker process died while starting ({said[1]})",
                       seconds=time.monotonic() - pending.started)

    def _lose(self) -> None:
        """The instance is gone (killed, dead or hung): never call it again; the next reset starts afresh."""
        if self._channel is not None:
            self._channel.end()
        self._channel, self._live = None, False

    def start(self) -> Outcome:
        self.begin_start()
        return self.result()

    def reset(self, task: dict, seed: int, name: str | None = None) -> Outcome:
        self.begin_reset(task, seed, name)
        return self.result()

    def step(self, action: Action) -> Outcome:
        self.begin_step(action)
        return self.result()

    def close(self) -> Outcome:
        self.begin_close()
        return self.result()

    def shutdown(self) -> None:
        """Stop the worker (process isolation); the runner can still start a new one with the next reset."""
        if isinstance(self._channel, _ProcessChannel):
            self._channel.shutdown()
        self._channel, self._live, self._pending = None, False, None

    def __enter__(self) -> "EnvRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live and self._pending is None:
            self.close()
        self.shutdown()


def _collect(runners: Sequence[EnvRunner]) -> list[Outcome]:
    """Every runner's result; an EnvLoadError is raised after all have been collected."""
    outcomes, error = [], None
    for runner in runners:
        try:
            outcomes.append(runner.result())
        except EnvLoadError as exc:
            error = error or exc
    if error is not None:
        raise error
    return outcomes


def start_all(runners: Sequence[EnvRunner]) -> list[Outcome]:
    """Start every runner's worker at once (see ``EnvRunner.begin_start``)."""
    for runner in runners:
        runner.begin_start()
    return _collect(runners)


def reset_all(runners: Sequence[EnvRunner], tasks: Sequence[dict], seeds: Sequence[int],
              names: Sequence[str | None] | None = None) -> list[Outcome]:
    """``reset`` on every runner at once (a group: the same task and seed G times)."""
    for i, (runner, task, seed) in enumerate(zip(runners, tasks, seeds, strict=True)):
        runner.begin_reset(task, seed, names[i] if names is not None else None)
    return _collect(runners)


def step_all(runners: Sequence[EnvRunner], actions: Sequence[Action]) -> list[Outcome]:
    """``step`` on every runner at once; each waits until its own deadline."""
    for runner, action in zip(runners, actions, strict=True):
        runner.begin_step(action)
    return _collect(runners)


def close_all(runners: Sequence[EnvRunner]) -> list[Outcome]:
    """``close`` on every runner at once."""
    for runner in runners:
        runner.begin_close()
    return _collect(runners)
