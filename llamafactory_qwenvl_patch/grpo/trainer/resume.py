"""An interrupted run resumes as the same run (``stage: grpo``, and every stage under ``qwenvl_patch``).

What a plain Trainer checkpoint does not give:

- **The rollout of a reuse window** (GRPO). With ``grpo_num_iterations > 1`` or ``grpo_steps_per_generation >
  gradient_accumulation_steps`` one rollout serves several optimiser steps. A checkpoint inside that window stores the
  rollout (its micro-batches with their old and reference log-probs, advantages and normalisers) and the trainer's
  counters, so the resumed run optimises the same rollout again instead of sampling a new one (which would drop the
  stale log-probs, and so the clipping, and shift every later rollout). Saved per rank; plain tensors, lists and
  numbers only (``torch.load(weights_only=True)`` reads it).
- **A checkpoint a kill cut short, or one changed since.** A marker listing every file of the checkpoint with its
  size and sha256 is written last (after the processor and every rank's files); a checkpoint without a valid marker,
  or with a file of another size, is incomplete and is never resumed from. The checkpoint a run resumes from is
  hashed again first: a file changed since its marker (flipped bytes keep the size) is refused by name, since
  neither LF nor transformers checks what it loads. A run that writes markers says so in ``qwenvl_run.json`` before
  its first checkpoint (with its identity, which each marker copies: ``integration.run_identity`` compares it at
  resume); folders written before markers existed are judged by their files (a readable ``trainer_state.json`` of
  their step and no empty file) only in an ``output_dir`` without that record and without any marker.
- **Rotation that keeps a complete checkpoint.** ``save_total_limit`` deletes old checkpoints inside the save of the
  next one, before its marker: a kill in between left none complete. In a run that writes markers rotation only
  deletes complete checkpoints, never the newest complete one, and runs again once the marker is written (``rotate``).
- **Logs written after the checkpoint.** The rows a killed run logged after its last checkpoint are dropped when the
  run resumes, so each step appears once (``trim_jsonl``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from llamafactory_qwenvl_patch.grpo.rollout.shared_prefix import PrefixLayout
from llamafactory_qwenvl_patch.grpo.rollout.types import MicroBatch

MARKER = "qwenvl_checkpoint_complete.json"
RUN_FILE = "qwenvl_run.json"
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
    """Write the marker last: every file of the checkpoint with its size and sha256, and the identity and launch of
    the run that wrote it (from its ``output_dir``'s run record, when there is one)."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER}
    marker: dict[str, Any] = {"global_step": step, "files": files}
    record = read_run_record(folder.parent)
    for key, name in (("identity", "run"), ("launch", "launch")):
        if record is not None and isinstance(record.get(key), dict):
            marker[name] = record[key]
    _write_json(folder / MARKER, marker)


def forget_marker(folder: str | os.PathLike) -> None:
    """Remove the marker of a checkpoint about to be written again (a run resumed from an earlier step saves over
    it): its old list would call a half-rewritten folder complete."""
    Path(folder, MARKER).unlink(missing_ok=True)


def recorded_run(folder: str | os.PathLike, key: str = "run") -> dict[str, Any] | None:
    """The identity (``key="launch"``: the launch) of the run that wrote a checkpoint, as its marker records it
    (None before markers did)."""
    try:
        run = json.loads(Path(folder, MARKER).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, dict) else None


def write_run_record(output_dir: str | os.PathLike, identity: dict[str, Any],
                     launch: dict[str, Any] | None = None) -> None:
    """Record that the run in ``output_dir`` marks its checkpoints, and what it is (its identity, and the settings
    of this launch that each marker copies); written before its first one."""
    _write_json(Path(output_dir, RUN_FILE), {
        "identity": identity, **({"launch": launch} if launch is not None else {}),
        "note": f"every checkpoint-N here is complete only with its {MARKER}, and is resumed only by a run with "
                "this identity"})


def read_run_record(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    try:
        record = json.loads(Path(output_dir, RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


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


def marked_run(output_dir: str | os.PathLike) -> bool:
    """Whether the run in ``output_dir`` writes markers: its run record says so, or a checkpoint has one."""
    return Path(output_dir, RUN_FILE).is_file() or any((p / MARKER).is_file() for p in _checkpoints(output_dir))


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why one checkpoint cannot be resumed from (None when it is complete), judged as ``last_complete`` does."""
    folder = Path(folder)
    if not folder.is_dir():
        return "no such folder"
    return incomplete(folder, marked_run(folder.parent))


def last_complete(output_dir: str | os.PathLike) -> tuple[str | None, list[tuple[str, str]]]:
    """(the highest-numbered complete checkpoint of a run or None, [(checkpoint, why it is skipped)] for every
    higher-numbered one). Not verified: ``verify`` the one a run resumes from."""
    marked = marked_run(output_dir)
    skipped = []
    for folder in _checkpoints(output_dir):
        reason = incomplete(folder, marked)
        if reason is None:
            return str(folder), skipped
        skipped.append((str(folder), reason))
    return None, skipped


def rotate(output_dir: str | os.PathLike, limit: int | None, best: str | None = None) -> None:
    """``save_total_limit`` in a run that writes markers: delete the oldest complete checkpoints beyond ``limit``,
    never the newest complete one (what a relaunch resumes from) nor ``best``, and never an incomplete one (being
    written now, or cut short: a relaunch skips it, and the run writes that step again)."""
    if not limit or limit <= 0:
        return
    complete = [p for p in _checkpoints(output_dir) if incomplete(p) is None]  # newest first
    protected = set(complete[:1]) | ({Path(best)} & set(complete) if best else set())
    excess = len(complete) - max(limit, len(protected))
    for folder in [p for p in reversed(complete) if p not in protected][:max(excess, 0)]:
        shutil.rmtree(folder, ignore_errors=True)


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
