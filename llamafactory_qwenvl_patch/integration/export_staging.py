"""A pinned export is written whole or not at all.

LF's ``export_model`` writes the weights straight into ``export_dir``; when the processor files or the policy record
then failed, the export stopped with ``ExportError`` but left a folder that transformers loaded without the policy,
in the processor's default bounds. So LF writes into a hidden folder inside ``export_dir``, whose files are moved up
only once the frame's files landed and the portable rewrite is done (``config.json`` last: without it nothing loads
the folder as a model); a failure removes it, and ``export_dir`` too when the export created it.

``export_dir`` must be empty or absent: merged into another folder's files, a stale one is read before the new ones
(a single ``model.safetensors`` beside new shards, an old ``video_preprocessor_config.json``), and the user's files
are not this export's to replace or delete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

STAGING_PREFIX = ".qwenvl-export-partial-"
LAST = "config.json"  # moved into place last


class ExportError(RuntimeError):
    """A pinned export that could not be written whole (nothing of it is left), or an ``export_dir`` it would
    have mixed with other files."""


@dataclass(frozen=True)
class Staging:
    """Where LF writes a pinned export (``folder``), for ``target``, the user's ``export_dir``."""

    target: Path
    folder: Path
    created: bool  # whether this export made ``target``


def stage(export_dir: str | os.PathLike) -> Staging:
    """The hidden folder a pinned export is written into, inside ``export_dir`` (created when absent). Raises
    ExportError, before any model loads, when ``export_dir`` holds anything."""
    target = Path(export_dir)
    if target.exists() and not target.is_dir():
        raise ExportError(f"export_dir {target} is not a folder; choose another export_dir")
    held = sorted(entry.name for entry in target.iterdir()) if target.is_dir() else []
    if held:
        leftover = [name for name in held if name.startswith(STAGING_PREFIX)]
        why = (f" ({', '.join(leftover)}: what an export killed before its end left)" if leftover else "")
        raise ExportError(
            f"export_dir {target} is not empty: it holds {', '.join(held[:5])}"
            f"{f' and {len(held) - 5} more' if len(held) > 5 else ''}"
            f"{why}. A pinned export writes a whole folder and mixes with no other files (a stale weights or "
            "processor file would be read before the new ones), so it stops before loading the model. Remove that "
            "folder or move it away, or choose another export_dir.")
    created = not target.exists()
    try:
        target.mkdir(parents=True, exist_ok=True)
        return Staging(target, Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target)), created)
    except OSError as exc:
        if created and target.is_dir():
            target.rmdir()
        raise ExportError(f"cannot write into export_dir {target}: {exc.strerror or exc}; choose a folder this "
                          "user can write") from None


def publish(staging: Staging) -> None:
    """Move the finished export up into ``export_dir``, ``config.json`` last; on a failure what was moved goes
    back, so ``discard`` removes all of it."""
    entries = sorted(staging.folder.iterdir(), key=lambda entry: entry.name == LAST)
    moved: list[tuple[Path, Path]] = []
    try:
        for entry in entries:
            os.rename(entry, staging.target / entry.name)
            moved.append((staging.target / entry.name, entry))
    except BaseException:
        for there, back in reversed(moved):
            os.rename(there, back)
        raise
    staging.folder.rmdir()


def discard(staging: Staging) -> str:
    """Remove the partial export (and ``export_dir`` when this export created it); says what was removed."""
    shutil.rmtree(staging.folder, ignore_errors=True)
    if staging.created:
        try:
            staging.target.rmdir()
        except OSError:
            pass
    left = staging.folder.exists() or (staging.created and staging.target.exists())
    if left:
        return (f"Removing the partial export {staging.folder} failed: delete it (and {staging.target}) yourself, "
                "and do not load it.")
    where = (f"{staging.target}, which this export created, is gone with it" if staging.created
             else f"{staging.target} is as it was, empty")
    return (f"Nothing of this export is left: the partial folder LF wrote ({staging.folder.name}) was removed, and "
            f"{where}.")
