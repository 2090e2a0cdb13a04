"""An interrupted GRPO run resumes as the same run.

Three things a plain Trainer checkpoint does not give GRPO:

- **The rollout of a reuse window.** With ``grpo_num_iterations > 1`` or ``grpo_steps_per_generation >
  gradient_accumulation_steps`` one rollout serves several optimiser steps. A checkpoint inside that window stores the
  rollout (its micro-batches with their old and reference log-probs, advantages and normalisers) and the trainer's
  counters, so the resumed run optimises the same rollout again instead of sampling a new one (which would drop the
  stale log-probs, and so the clipping, and shift every later rollout). Saved per rank; plain tensors, lists and
  numbers only (``torch.load(weights_only=True)`` reads it).
- **A checkpoint a kill cut short, or one changed since.** A marker listing every file of the checkpoint with its
  size and sha256 is written last (after the processor and every rank's files); a checkpoint without a valid marker,
  or with a file of another size, is incomplete and is never resumed from. The checkpoint a run resumes from is
  hashed again first: a file changed since its marker (flipped bytes keep the size) is refused by name, since
  neither LF nor transformers checks what it loads. Folders written before the marker existed are judged by their
  files (a readable ``trainer_state.json`` of their step and no empty file) while no checkpoint of the run has a
  marker.
- **Logs written after the checkpoint.** The rows a killed run logged after its last checkpoint are dropped when the
  run resumes, so each step appears once (``trim_jsonl``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from llamafactory_qwenvl_patch.grpo.rollout import MicroBatch
from llamafactory_qwenvl_patch.grpo.shared_prefix import PrefixLayout

MARKER = "qwenvl_checkpoint_complete.json"
STATE_FILE = "grpo_state_rank{rank}.pt"
_CLASSES = {cls.__name__: cls for cls in (MicroBatch, PrefixLayout)}
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 1 << 20


class ChangedCheckpointError(ValueError):
    """A complete checkpoint whose file no longer holds what was written: resuming would carry it on silently."""


# --- the trainer's state between two optimiser steps ---------------------------------------------------------------

def _pack(value: Any) -> Any:
    """``value`` as tensors on the CPU, dicts, lists and plain scalars (dataclasses as tagged dicts)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__class__": type(value).__name__,
                **{f.name: _pack(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        return {key: _pack(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_pack(item) for item in value]
    return value


def _unpack(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        items = {key: _unpack(item, device) for key, item in value.items() if key != "__class__"}
        return _CLASSES[value["__class__"]](**items) if "__class__" in value else items
    if isinstance(value, list):
        return [_unpack(item, device) for item in value]
    return value


def save_state(folder: str | os.PathLike, rank: int, state: dict[str, Any]) -> None:
    """Write one rank's GRPO state (``state``: the rollout buffer or None, counters, pending metrics) into a
    checkpoint folder."""
    path = Path(folder, STATE_FILE.format(rank=rank))
    tmp = path.with_name(path.name + ".tmp")
    torch.save(_pack(state), tmp)
    os.replace(tmp, path)


def load_state(folder: str | os.PathLike, rank: int, device: torch.device) -> dict[str, Any] | None:
    """The state ``save_state`` wrote for this rank, on ``device``; None when the checkpoint has none (written
    before this existed)."""
    path = Path(folder, STATE_FILE.format(rank=rank))
    if not path.is_file():
        return None
    return _unpack(torch.load(path, map_location="cpu", weights_only=True), device)


# --- complete checkpoints ----------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def mark_complete(folder: str | os.PathLike, step: int) -> None:
    """Write the marker last: every file of the checkpoint with its size and sha256."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER}
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"global_step": step, "files": files}, indent=1))
    os.replace(tmp, folder / MARKER)


def _step(folder: Path) -> int | None:
    match = _CHECKPOINT.match(folder.name)
    return int(match.group(1)) if match else None


def incomplete(folder: str | os.PathLike, marked_run: bool = True) -> str | None:
    """Why the checkpoint ``folder`` cannot be resumed from (None when it is complete). ``marked_run``: the run
    writes markers (else only its files are judged, for checkpoints written before markers existed)."""
    folder = Path(folder)
    if marked_run:
        files = _marked_files(folder)
        if files is None:
            return f"no complete-marker {MARKER} (written last)"
        for name, (size, _) in files.items():
            path = folder / name
            if not path.is_file() or path.stat().st_size != size:
                return f"{name} is missing or has another size than when it was written"
        return None
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return "no readable trainer_state.json"
    if state.get("global_step") != _step(folder):
        return f"trainer_state.json is for step {state.get('global_step')}"
    empty = [p.name for p in folder.rglob("*") if p.is_file() and p.stat().st_size == 0]
    return f"{empty[0]} is empty" if empty else None


def _marked_files(folder: Path) -> dict[str, tuple[int, str | None]] | None:
    """The marker's files as name -> (size, sha256 or None: a marker written before checksums); None when the marker
    is missing or unreadable."""
    try:
        files = json.loads((folder / MARKER).read_text())["files"]
        listed = {}
        for name, entry in dict(files).items():
            entry = entry if isinstance(entry, dict) else {"size": entry}
            size, digest = entry["size"], entry.get("sha256")
            if not isinstance(size, int) or not (digest is None or isinstance(digest, str)) or ".." in Path(name).parts:
                return None
            listed[str(name)] = (size, digest)
        return listed
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def verify(folder: str | os.PathLike) -> None:
    """Hash a complete checkpoint's files against its marker before a run resumes from it; a mismatch raises
    ``ChangedCheckpointError`` naming the file. A checkpoint without a marker, or with one written before
    checksums, has nothing to verify."""
    folder = Path(folder)
    for name, (_, digest) in (_marked_files(folder) or {}).items():
        if digest is not None and sha256(folder / name) != digest:
            raise ChangedCheckpointError(
                f"{folder / name} changed since the checkpoint was written (same size, other sha256 than its "
                f"{MARKER} records): refusing to resume from it. Restore the file, or remove {folder} to resume from "
                "an earlier checkpoint")


def _checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of a run, highest N first."""
    if not Path(output_dir).is_dir():
        return []
    return sorted((p for p in Path(output_dir).iterdir() if p.is_dir() and _step(p) is not None), key=_step,
                  reverse=True)


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why one checkpoint cannot be resumed from (None when it is complete), judged as ``last_complete`` does."""
    folder = Path(folder)
    if not folder.is_dir():
        return "no such folder"
    return incomplete(folder, any((p / MARKER).is_file() for p in _checkpoints(folder.parent)))


def last_complete(output_dir: str | os.PathLike) -> tuple[str | None, list[tuple[str, str]]]:
    """(the highest-numbered complete checkpoint of a run or None, [(checkpoint, why it is skipped)] for every
    higher-numbered one). Not verified: ``verify`` the one a run resumes from."""
    folders = _checkpoints(output_dir)
    marked_run = any((p / MARKER).is_file() for p in folders)
    skipped = []
    for folder in folders:
        reason = incomplete(folder, marked_run)
        if reason is None:
            return str(folder), skipped
        skipped.append((str(folder), reason))
    return None, skipped


def trim_jsonl(path: str | os.PathLike, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Drop the rows of a JSONL log that ``keep`` rejects (rewritten atomically); returns how many were dropped. A
    line that is not a JSON object (cut short by a kill) is dropped too."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and keep(row):
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped
