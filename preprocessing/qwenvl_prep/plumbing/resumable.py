"""A JSON-lines output that a stopped run continues: rows go to ``OUTPUT.partial`` batch by batch (each batch one
write, flushed to disk), the run's settings to ``OUTPUT.partial.settings.json`` before the first row; a relaunch with
the same settings skips the whole batches already there (a batch cut by a kill is dropped and written again, so each
batch is answered as the uninterrupted run answers it), one with other
settings is refused naming them, and only a finished run renames both into ``OUTPUT`` and ``OUTPUT.settings.json``.
Two runs at once into one output are refused (an flock held while writing).

The finish is four steps, ordered so that a kill after any of them leaves what the next run resumes or finishes, and
never an ``OUTPUT`` beside another run's settings: the old ``OUTPUT.settings.json`` and ``OUTPUT`` are removed, the
settings renamed, then the rows. Killed after the settings' rename, ``OUTPUT.partial`` stands with its settings at
``OUTPUT.settings.json``: the next run takes them back and, every batch being there, finishes."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any, Iterable

from qwenvl_prep.plumbing.atomic import atomic_writer
from qwenvl_prep.plumbing.outputs import require_regular_output


class ResumeConflict(ValueError):
    """A partial output written with other settings, or by a run still going."""


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The keys (dotted) whose values differ between two settings records."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [name for key in sorted(set(old) | set(new), key=str)
                for name in _differences(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [prefix.rstrip(".")]


class ResumableOutput:
    """``with ResumableOutput(path, settings) as out``: ``out.done`` rows are already written; ``out.append(rows)``
    adds a batch; leaving the block without an error finishes the output."""

    def __init__(self, path: Path, settings: dict[str, Any], batch: int = 1) -> None:
        self.path = Path(path)
        self.batch = batch  # rows per append: a resumed run keeps whole batches only
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.partial_settings = self.path.with_name(self.path.name + ".partial.settings.json")
        self.settings_path = self.path.with_name(self.path.name + ".settings.json")
        self.settings = settings
        self.done = 0
        self._file: Any = None

    def outputs(self) -> list[Path]:
        """Every path this output writes, for the caller's output guard."""
        return [self.path, self.partial, self.partial_settings, self.settings_path]

    def __enter__(self) -> "ResumableOutput":
        for path in self.outputs():
            if path.is_symlink():
                raise ResumeConflict(f"{path} is a symbolic link; it is not followed")
            require_regular_output(path, "output")
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.partial, "a+b")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise ResumeConflict(f"another run is writing {self.partial}; wait for it, or write elsewhere") from None
        self._file.seek(0)
        data = self._file.read()
        if data:
            self._check_settings()
            lines = data.count(b"\n")  # a line cut by a kill, and the rest of its batch, are written again
            self.done = lines - lines % self.batch
            end = 0
            for _ in range(self.done):
                end = data.index(b"\n", end) + 1
            if end != len(data):
                self._file.truncate(end)
        else:
            with atomic_writer(self.partial_settings) as f:
                f.write(json.dumps(self.settings, indent=2, ensure_ascii=False) + "\n")
        return self

    def _check_settings(self) -> None:
        """The rows' settings must be these. A run killed inside the finish left them at ``OUTPUT.settings.json``
        (``OUTPUT.partial.settings.json`` gone): they are taken back from there."""
        moved = not self.partial_settings.exists() and self.settings_path.exists()
        where = self.settings_path if moved else self.partial_settings
        try:
            recorded = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ResumeConflict(f"{self.partial} has rows but its settings ({where}) cannot be read ({exc}); delete "
                                 "both to start over") from None
        changed = _differences(recorded, self.settings)
        if changed:
            raise ResumeConflict(f"{self.partial} was written with other settings ({', '.join(changed)} differ: "
                                 f"{where} has them); rerun with the same ones to continue it, or delete both files "
                                 "to start over")
        if moved:
            os.replace(self.settings_path, self.partial_settings)

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        """One batch of rows, in one write, flushed to disk before the next batch starts."""
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
        self._file.seek(0, os.SEEK_END)
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done += data.count(b"\n")

    def rows(self) -> list[dict[str, Any]]:
        """Every row written so far, in order."""
        self._file.seek(0)  # split at "\n" alone: str.splitlines would also split inside rows at U+2028 and kin
        return [json.loads(line) for line in self._file.read().split(b"\n") if line]

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        try:
            if kind is None:  # each step leaves a state the next run resumes or finishes (module docstring)
                self.settings_path.unlink(missing_ok=True)
                self.path.unlink(missing_ok=True)
                os.replace(self.partial_settings, self.settings_path)
                os.replace(self.partial, self.path)
        finally:
            self._file.close()
