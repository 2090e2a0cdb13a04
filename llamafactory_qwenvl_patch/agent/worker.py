"""The environment's side of the boundary: one instance per trajectory, its calls and the checks of what it returns,
in a worker process (``serve``, process isolation) or a thread of the trainer (``EnvHost``, inline isolation).

Every call answers with a reply: ``("ok", value)`` or ``("error", what went wrong, traceback or None)``; a worker
first says whether it loaded the class. The runner (``runner``) times them.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

from llamafactory_qwenvl_patch.agent.checks import BoundaryError, check_observation, check_step
from llamafactory_qwenvl_patch.agent.loading import EnvLoadError, load_env_class
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy

Reply = tuple  # ("ok", value) | ("error", detail, traceback | None); from a worker also ("ready", clock),
# ("load_error", message) and, seen by the runner, ("died", how)


class EnvHost:
    """Holds the instance of the trajectory in progress: ``reset`` makes a new one with the run's keyword arguments,
    ``close`` ends it."""

    def __init__(self, env_class: type, kwargs: dict[str, Any], policy: ResizePolicy) -> None:
        self.env_class, self.kwargs, self.policy = env_class, kwargs, policy
        self.env: Any = None

    def perform(self, call: str, *args: Any) -> Reply:
        """Run one call (``reset`` task, seed; ``step`` action, turn; ``close``) and check what it returns. What the
        environment raises (``sys.exit`` included) is an error reply with its traceback; a value the checks refuse is
        one without (the message says what)."""
        try:
            if call == "reset":
                task, seed = args
                self.env = None
                self.env = self.env_class(**self.kwargs)
                return "ok", check_observation(self.env.reset(task, seed), self.policy, turn=1)
            if call == "step":
                action, turn = args
                return "ok", check_step(self.env.step(action), self.policy, turn)
            if call == "close":
                env, self.env = self.env, None
                if env is not None:
                    env.close()
                return "ok", None
            raise ValueError(f"unknown call {call!r}")
        except BoundaryError as exc:
            return "error", str(exc), None
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the environment's code: a failure of its trajectory
            return "error", f"raised {type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)).rstrip()


def serve(conn: Any, spec: str, kwargs: dict[str, Any], policy: ResizePolicy) -> None:
    """A worker process's loop: load the class and say so (``("ready", time.monotonic())``, the clock every process
    shares, so the first call's timeout starts then; or ``("load_error", message)`` and exit), then answer each
    message ``(call, *args)`` until ``shutdown`` or until the trainer's end of the pipe closes. A value that cannot
    be sent (it does not pickle) is an error reply naming why."""
    try:
        host = EnvHost(load_env_class(spec), kwargs, policy)
    except EnvLoadError as exc:
        conn.send(("load_error", str(exc)))
        return
    conn.send(("ready", time.monotonic()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "shutdown":
            return
        reply = host.perform(*message)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - pickling the environment's value: its own classes, locks, files
            conn.send(("error", f"returned a value that cannot be sent to the trainer's process: "
                                f"{type(exc).__name__}: {exc}", None))
