"""The ``dataset_info.json`` side of a convert: the entry LF reads a converted file by, the names LF can use, and
merging one entry under a lock so that concurrent converts keep each other's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.stamp import read_dataset_info
from qwenvl_prep.plumbing.atomic import exclusive, write_json


class DatasetNameError(ValueError):
    """A dataset name LF cannot use as a ``dataset:`` entry."""


SHAREGPT_ENTRY = {
    "formatting": "sharegpt",
    "columns": {"messages": "messages", "images": "images"},
    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
             "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"},
}


def check_dataset_name(name: str) -> None:
    """DatasetNameError for a name LF cannot use as a ``dataset:`` entry: LF splits ``dataset: a,b`` at commas, and a
    name that looks like a path (``../../x``), starts with a dot or holds control characters is a mistake."""
    bad = (not name or name != name.strip() or name.startswith(".") or any(c in name for c in ",/\\")
           or any(not c.isprintable() for c in name))
    if bad:
        raise DatasetNameError(f"dataset name {name!r} cannot be a dataset_info.json entry LF reads: use letters, digits, "
                           "spaces and . _ + - (no commas: LF splits `dataset:` at them; no slashes: a name is not a "
                           "path); set it with --dataset-name")


def merge_dataset_info(folder: Path, name: str, entry: dict[str, Any]) -> None:
    """Set one entry of ``folder/dataset_info.json`` under a lock, so concurrent converts keep each other's entries."""
    info_path = folder / "dataset_info.json"
    with exclusive(info_path):
        info = read_dataset_info(folder)
        info[name] = entry
        write_json(info_path, info, follow_symlink=True)  # a shared registry linked into the folder stays shared
