"""A decision global rank 0 makes for every rank: the guards that read or lock the shared ``output_dir`` run once, and
every rank gets the same answer, or the same error, so no rank goes on alone or waits forever for the others."""

from __future__ import annotations

import pickle
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def on_rank_zero(work: Callable[[], T]) -> T:
    """``work()`` on global rank 0, its result (or its exception) on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return work()
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [(work(), None)]
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others wait forever
            outcome = [(None, exc if _picklable(exc) else RuntimeError(f"{type(exc).__name__}: {exc}"))]
    dist.broadcast_object_list(outcome, src=0)
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


def _picklable(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - whatever pickle cannot carry is sent as text
        return False
    return True
