"""DeepSpeed ZeRO-3's start-of-forward hook, set aside while a rank samples on gathered weights.

trl's ``unwrap_model_for_generation`` gathers every parameter and removes ZeRO-3's per-module hooks, so a forward in
it fetches nothing. DeepSpeed also registers a forward pre-hook on the top module (``DeepSpeedZeRoOffload.
fwd_pre_hook``, its ``_start_of_forward_hook``), which trl leaves: it calls the coordinator's ``reset_step``, and
while the coordinator's module trace is being recorded (or after it is found invalid) that runs collectives across
ranks. Ranks that sample for as many turns as their own trajectories last run different numbers of forwards, so
those collectives pair up wrongly and the run hangs. Inside the gathered context the hook has nothing to do; it is
set aside there and put back, in its place, after.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


class Zero3HookError(RuntimeError):
    """DeepSpeed's start-of-forward hook is not where this module reads it (another DeepSpeed release)."""


@contextmanager
def start_of_forward_hook_removed(engine: Any) -> Iterator[None]:
    """Within the block, the model of the ZeRO-3 ``engine`` runs forwards without DeepSpeed's start-of-forward hook.
    Zero3HookError, naming the DeepSpeed version, when the hook is not found where DeepSpeed 0.19 keeps it: an agent
    run would otherwise hang rather than fail."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    handle = getattr(offload, "fwd_pre_hook", None)
    hooks = handle.hooks_dict_ref() if handle is not None and hasattr(handle, "hooks_dict_ref") else None
    if hooks is None or getattr(handle, "id", None) not in hooks:
        import deepspeed

        raise Zero3HookError(f"deepspeed {deepspeed.__version__}: ZeRO-3's start-of-forward hook "
                             "(DeepSpeedZeRoOffload.fwd_pre_hook) is not where the plugin sets it aside while an agent "
                             "rollout samples; install the tested set (pip install -c constraints.txt)")
    hook = hooks.pop(handle.id)
    try:
        yield
    finally:
        hooks[handle.id] = hook
        if hasattr(hooks, "move_to_end"):  # back in its place: before the hooks registered after it
            for later in [key for key in hooks if key > handle.id]:
                hooks.move_to_end(later)
