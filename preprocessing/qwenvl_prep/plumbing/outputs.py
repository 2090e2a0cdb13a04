"""Where a ``qwenvl-prep`` command may write, checked before it writes anything.

Never onto one of its inputs, onto a file that a ``dataset_info.json`` entry uses (or a registry itself), through a
symbolic link it did not create, onto anything but a regular file (a named pipe, a socket or a device: the rename
that finishes an output would replace it, and a reader waiting on a pipe would wait forever), or outside its output
folder. Every command checks each output path here first, so
a refusal names the path and leaves every file as it was.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable

from llamafactory_qwenvl_patch.frame.stamp import read_dataset_info
from llamafactory_qwenvl_patch.image_io.images import file_kind

REGISTRY = "dataset_info.json"


class UnsafeOutput(ValueError):
    """An output path that would overwrite something the command must not touch."""


def registered_files(folder: Path) -> dict[Path, str]:
    """Resolved path -> entry name for every local file (or folder) the registry in ``folder`` names (a file name
    that points at the registry's own folder or above claims nothing: LF cannot load it either)."""
    files, home = {}, folder.resolve()
    for name, entry in read_dataset_info(folder).items():
        file_name = entry.get("file_name") if isinstance(entry, dict) else None
        if isinstance(file_name, str) and file_name.strip():
            used = (folder / file_name).resolve()
            if used != home and used not in home.parents:
                files[used] = name
    return files


def require_regular_output(path: Path, what: str) -> None:
    """Refuse an output path that exists and is not a regular file (a FIFO, a socket, a device): every output is
    written beside it and renamed over it, which would replace it (and leave a reader of a pipe waiting)."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # created by the run (a parent that is a file fails by name when it is made)
    if not stat.S_ISREG(mode):
        raise UnsafeOutput(f"{what} {path} is {file_kind(mode)}, not a regular file; qwenvl-prep writes a file and "
                           "renames it into place, which would replace it (write to a regular path, then copy it "
                           "where it should go)")


def _not_a_folder(mode: int) -> str:
    """What a path that should be a folder is instead (``a file``, ``a FIFO``, ...)."""
    return "a file" if stat.S_ISREG(mode) else file_kind(mode)


def require_new_folder(out: Path) -> None:
    """Refuse an output folder that holds anything (a command that makes a folder never writes over files) or that
    is not a folder (a named pipe, a file: ``Not a directory`` named no path and said nothing of what it was)."""
    try:
        mode = out.stat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise UnsafeOutput(f"{out} is {_not_a_folder(mode)}, not a folder; give a new folder")
    if any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder")


class Outputs:
    """What a run must not write onto: its inputs (and anything inside an input folder, such as a model folder) and
    the files of every registry it reads, or writes beside. Build once, then ``check`` each output path."""

    def __init__(self, inputs: Iterable[str | os.PathLike] = (), registries: Iterable[str | os.PathLike] = ()) -> None:
        self.inputs = {Path(p).resolve() for p in inputs}
        self._registries: dict[Path, dict[Path, str]] = {}
        for folder in registries:
            self._registered(Path(folder).resolve())

    def _registered(self, folder: Path) -> dict[Path, str]:
        if folder not in self._registries:
            self._registries[folder] = registered_files(folder)
        return self._registries[folder]

    def check(self, path: str | os.PathLike, what: str, *, inside: str | os.PathLike | None = None,
              own_entry: str | None = None) -> Path:
        """Refuse ``path`` (named ``what`` in the message, e.g. ``--json-out``) when it is a symbolic link, a
        folder or anything else that is not a regular file (a FIFO, a socket, a device), a registry, an input or
        inside an input folder, outside ``inside``, a file that a registry entry other than ``own_entry`` uses (the
        registry beside it and those given), or in a folder that is not writable. Returns the path."""
        path = Path(path)
        if path.is_symlink():
            raise UnsafeOutput(f"{what} {path} is a symbolic link; qwenvl-prep does not write through links it did "
                               "not create (give the real path)")
        if path.is_dir():
            raise UnsafeOutput(f"{what} {path} is a directory, not a file to write")
        require_regular_output(path, what)
        if path.name == REGISTRY:
            raise UnsafeOutput(f"{what} {path} would replace the dataset registry {REGISTRY}")
        target = path.resolve()
        if inside is not None and Path(inside).resolve() not in target.parents:
            raise UnsafeOutput(f"{what} {path} lies outside the output folder {inside}")
        source = next((p for p in (target, *target.parents) if p in self.inputs), None)
        if source is not None:
            raise UnsafeOutput(f"{what} {path} is {'inside ' if source != target else ''}an input of this run "
                               f"({source}); inputs are never overwritten")
        self._registered(target.parent)
        for folder, files in self._registries.items():
            name = next((n for used, n in files.items() if used == target or used in target.parents), None)
            if name is not None and name != own_entry:
                raise UnsafeOutput(f"{what} {path} is the file of dataset {name!r} in {folder / REGISTRY}; choose "
                                   "another path")
        parent = next((p for p in target.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise UnsafeOutput(f"{what} {path}: {parent} is {_not_a_folder(parent.stat().st_mode)}, not a folder")
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            raise UnsafeOutput(f"{what} {path}: the folder {parent} is not writable")
        return path


def check_output(path: str | os.PathLike, what: str, *, inputs: Iterable[str | os.PathLike] = (),
                 registries: Iterable[str | os.PathLike] = (), inside: str | os.PathLike | None = None,
                 own_entry: str | None = None) -> Path:
    """``Outputs(inputs, registries).check(path, what, ...)`` for a command with one or two outputs."""
    return Outputs(inputs, registries).check(path, what, inside=inside, own_entry=own_entry)
