"""A multi-node run must write one ``output_dir`` that every node sees: checked at start, before any step.

With a separate local disk per node, each node keeps only its own checkpoint shards (ZeRO-3 optimiser states, the
RNG state of its ranks), and a resume then has node 0 resuming from step N while node 1 finds no complete
checkpoint and starts from 0; the run dies later inside the collective with an unrelated size mismatch. Rank 0
writes a token file into ``output_dir``, every rank reads it, and all ranks agree on the result, so each node stops
with the same message, naming ``output_dir`` and the hosts that do not see it.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

TOKEN_PREFIX = ".qwenvl_shared_output_dir."


class SharedStorageError(RuntimeError):
    """``output_dir`` is not one folder for all ranks (separate disks on a multi-node run)."""


def check_shared_output_dir(output_dir: str | os.PathLike) -> None:
    """Raise SharedStorageError on every rank unless every rank sees the token file rank 0 wrote into
    ``output_dir``. A no-op without an initialised process group of more than one rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    rank = dist.get_rank()
    folder = Path(output_dir)
    message = [None]
    if rank == 0:
        token = uuid.uuid4().hex
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{TOKEN_PREFIX}{token}").write_text(token)
        message = [token]
    dist.broadcast_object_list(message, src=0)
    token = message[0]
    path = folder / f"{TOKEN_PREFIX}{token}"
    try:
        seen = path.read_text() == token
    except OSError:
        seen = False
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (rank, socket.gethostname(), seen))
    dist.barrier()  # every rank has read it before rank 0 removes it
    if rank == 0:
        path.unlink(missing_ok=True)
    missing = [(r, host) for r, host, ok in views if not ok]
    if missing:
        where = ", ".join(f"rank {r} on {host}" for r, host in missing)
        raise SharedStorageError(
            f"output_dir {str(folder)!r} is not one folder for every node: rank 0 on {views[0][1]} wrote a file "
            f"there that {where} cannot read. A multi-node run needs output_dir on storage all nodes share (NFS, "
            "Lustre, a mounted bucket): with a local disk per node each node keeps only its own checkpoint shards "
            "and a resume fails. Point output_dir at a shared path on every node.")
