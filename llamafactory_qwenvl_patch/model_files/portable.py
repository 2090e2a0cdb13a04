"""The portable layout of a Qwen-VL model folder: files that transformers 4.49 to 5.x and vLLM 0.11 all read, and
read in the training frame.

What transformers 5.x writes and older readers get wrong (each checked against the real readers):
- ``config.json``: see ``config_layout`` (flat for Qwen2/2.5-VL; for Qwen3-VL 4.x's rope keys beside
  5.x's and the top level's ``tie_word_embeddings`` in ``text_config``).
- ``tokenizer_config.json``: ``tokenizer_class: TokenizersBackend`` (5.x's generic class: "does not exist" in 4.x),
  a ``backend`` key, and ``extra_special_tokens`` as a list (4.x wants a dict: "'list' object has no attribute
  'keys'"). vLLM hands its tokenizer to the 4.57 Qwen-VL processor, which accepts only a Qwen2 class, so the
  portable file names ``Qwen2TokenizerFast``, and only when ``tokenizer.json`` is Qwen2's pipeline: 5.x maps that
  name to its ``Qwen2Tokenizer``, which rebuilds the normaliser and pre-tokenizer from the class (measured: another
  pipeline gives other ids there). The special tokens are listed as ``additional_special_tokens``.
- ``preprocessor_config.json``: 5.x keeps the bounds only in ``size``; 4.x's slow ``Qwen2VLImageProcessor`` ignores
  ``size`` and resizes with its defaults unless ``min_pixels`` / ``max_pixels`` are there, and vLLM 0.11 reads
  ``image_processor.max_pixels`` for Qwen2/2.5-VL (``size`` for Qwen3-VL). The portable file has both, equal.
- ``processor_config.json``: 5.x nests the image and video processors there; 4.49 to 4.51 fail on the nested dicts,
  4.57 ignores them (its video processor then falls back to the image processor's file and bounds). The portable
  layout keeps each in its own file (``preprocessor_config.json``, ``video_preprocessor_config.json``), which 5.x
  also reads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model_type
from llamafactory_qwenvl_patch.model_files.config_layout import flatten, layout, nested_for_4x, nested_only
from llamafactory_qwenvl_patch.model_files.folder import (
    CONFIG, IMAGE_PROCESSOR, PROCESSOR, TOKENIZER_CONFIG, VIDEO_PROCESSOR, FileEdit, ModelFolder, NotPortableError,
)

# tokenizer classes a 4.x Qwen-VL processor (and so vLLM, which hands it its tokenizer) accepts
QWEN_TOKENIZER_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast")
PORTABLE_TOKENIZER_CLASS = "Qwen2TokenizerFast"
# 5.x's generic class: what 5.x writes for a tokenizer built from a plain ``tokenizer.json``
GENERIC_5X_TOKENIZER_CLASS = "TokenizersBackend"
# the pre-tokenizer split of Qwen2/2.5/3-VL's tokenizer.json (and of 5.x's Qwen2Tokenizer): digits one by one
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
# the sub-processors 5.x nests in processor_config.json
NESTED_SUB_PROCESSORS = ("image_processor", "video_processor", "tokenizer")


def portable_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    if layout(config) == "flat":
        return config, []
    if nested_only(config.get("model_type")):
        return nested_for_4x(config)
    return flatten(config)


def qwen2_pipeline(pipeline: dict[str, Any] | None) -> bool:
    """Whether ``tokenizer.json`` normalises and pre-tokenises exactly as 5.x's ``Qwen2Tokenizer`` rebuilds it (NFC,
    Qwen2's split, byte-level): only then may a generic tokenizer be named ``Qwen2TokenizerFast``."""
    pre = (pipeline or {}).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if ((pipeline or {}).get("normalizer") or {}).get("type") != "NFC" or not steps or len(steps) != 2:
        return False
    split, byte_level = steps
    return (split.get("type") == "Split" and (split.get("pattern") or {}).get("Regex") == QWEN2_SPLIT
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
            and not byte_level.get("use_regex"))


def portable_tokenizer_config(data: dict[str, Any], pipeline: dict[str, Any] | None
                              ) -> tuple[dict[str, Any], list[str]]:
    out, changes = dict(data), []
    cls = out.get("tokenizer_class")
    if cls == GENERIC_5X_TOKENIZER_CLASS:
        if not qwen2_pipeline(pipeline):
            raise NotPortableError(
                f"{TOKENIZER_CONFIG}: tokenizer_class {cls} with a tokenizer.json that is not Qwen2's (NFC, Qwen2's "
                "split, byte-level): transformers 4.x and vLLM need a Qwen2 tokenizer class, and 5.x would rebuild "
                "such a tokenizer's normaliser and pre-tokenizer from that class, so no class name reads the same "
                "everywhere")
        out["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
        changes.append(f"tokenizer_class {cls} -> {PORTABLE_TOKENIZER_CLASS} (tokenizer.json is Qwen2's)")
    elif cls not in QWEN_TOKENIZER_CLASSES:
        raise NotPortableError(
            f"{TOKENIZER_CONFIG}: tokenizer_class {cls!r} is not a Qwen2 tokenizer; transformers 4.x Qwen-VL "
            f"processors and vLLM need {' or '.join(QWEN_TOKENIZER_CLASSES)}")
    if "backend" in out:
        changes.append(f"removed backend={out.pop('backend')!r} (a transformers 5.x key)")
    extra = out.get("extra_special_tokens")
    if isinstance(extra, list):
        listed = list(out.get("additional_special_tokens") or [])
        out["additional_special_tokens"] = listed + [t for t in extra if t not in listed]
        del out["extra_special_tokens"]
        changes.append(f"extra_special_tokens (a list of {len(extra)}) -> additional_special_tokens")
    return out, changes


def size_bounds(data: dict[str, Any] | None) -> tuple[int, int] | None:
    size = (data or {}).get("size") or {}
    low, high = size.get("shortest_edge"), size.get("longest_edge")
    return (int(low), int(high)) if low and high else None


def key_bounds(data: dict[str, Any] | None) -> tuple[int, int] | None:
    low, high = (data or {}).get("min_pixels"), (data or {}).get("max_pixels")
    return (int(low), int(high)) if low and high else None


def nested(folder: ModelFolder, key: str) -> dict[str, Any] | None:
    value = (folder.get(PROCESSOR) or {}).get(key)
    return dict(value) if isinstance(value, dict) else None


def declared_bounds(folder: ModelFolder) -> dict[str, tuple[int, int]]:
    """Every place the folder states image bounds, by where it says so."""
    found = {}
    for where, data in ((IMAGE_PROCESSOR, folder.get(IMAGE_PROCESSOR)),
                        (f"{PROCESSOR} image_processor", nested(folder, "image_processor"))):
        for keys, bounds in (("size", size_bounds(data)), ("min_pixels/max_pixels", key_bounds(data))):
            if bounds:
                found[f"{where} {keys}"] = bounds
    return found


def frame_bounds(folder: ModelFolder) -> tuple[int, int]:
    """The folder's training frame: its ``qwenvl_policy.json``, else the bounds its processor files agree on; files
    that disagree with the record or with each other are refused (which one would a reader trust?)."""
    found = declared_bounds(folder)
    trained = folder.record_bounds()
    if trained is not None:
        for where, bounds in found.items():
            if bounds != trained:
                raise NotPortableError(
                    f"{where}: {bounds[0]}..{bounds[1]} differs from the training frame {trained[0]}..{trained[1]} "
                    "in qwenvl_policy.json; re-export the model with `qwenvl_patch: true`")
        return trained
    if not found:
        raise NotPortableError(f"{folder.path} has no image processor bounds ({IMAGE_PROCESSOR} / {PROCESSOR})")
    if len(set(found.values())) > 1:
        raise NotPortableError("the image bounds disagree: " + "; ".join(
            f"{where} {b[0]}..{b[1]}" for where, b in found.items()) + "; transformers 4.x and 5.x would resize "
            "differently")
    return next(iter(found.values()))


def with_bounds(data: dict[str, Any], bounds: tuple[int, int]) -> tuple[dict[str, Any], list[str]]:
    """The processor dict with the bounds in ``size`` and in ``min_pixels`` / ``max_pixels``."""
    low, high = bounds
    wanted = {"size": {**(data.get("size") or {}), "shortest_edge": low, "longest_edge": high},
              "min_pixels": low, "max_pixels": high}
    changed = [key for key, value in wanted.items() if data.get(key) != value]
    return {**data, **wanted}, [f"{key} = {json.dumps(wanted[key])}" for key in changed]


def _sub_processor_edit(name: str, current: dict[str, Any] | None, from_processor: dict[str, Any] | None,
                        bounds: tuple[int, int] | None) -> FileEdit | None:
    """The sub-processor's own file: what 5.x reads (the nested dict when there is one), with the bounds."""
    data, changes = current, []
    if from_processor is not None and from_processor != current:
        data = from_processor
        changes.append(f"written from {PROCESSOR}'s nested dict (what transformers 5.x reads)")
    if data is None:
        return None
    if bounds is not None:
        data, added = with_bounds(data, bounds)
        changes += added
    return FileEdit(name, data, changes) if changes else None


def processor_edits(folder: ModelFolder) -> list[FileEdit]:
    """Each sub-processor in its own file with the bounds in every key, and ``processor_config.json`` without the
    nested copies."""
    if folder.get(IMAGE_PROCESSOR) is None and nested(folder, "image_processor") is None:
        raise NotPortableError(f"{folder.path} has no image processor config ({IMAGE_PROCESSOR} or {PROCESSOR})")
    edits = [_sub_processor_edit(IMAGE_PROCESSOR, folder.get(IMAGE_PROCESSOR), nested(folder, "image_processor"),
                                 frame_bounds(folder)),
             _sub_processor_edit(VIDEO_PROCESSOR, folder.get(VIDEO_PROCESSOR), nested(folder, "video_processor"),
                                 None)]
    present = [key for key in NESTED_SUB_PROCESSORS if nested(folder, key) is not None]
    if present:
        rest = {k: v for k, v in folder.get(PROCESSOR).items() if k not in present}
        edits.append(FileEdit(PROCESSOR, rest, [f"removed the nested {', '.join(present)} (each is in its own "
                                                "file)"]))
    return [edit for edit in edits if edit is not None]


def portable_edits(folder: ModelFolder) -> list[FileEdit]:
    """Every file edit that puts the folder in the portable layout (none when it is already there)."""
    config = folder.get(CONFIG)
    if config is None:
        raise NotPortableError(f"{folder.path} has no {CONFIG}")
    if family_of_model_type(config.get("model_type")) is None:
        known = ", ".join(prefix for f in FAMILIES.values() for prefix in f.model_types)
        raise NotPortableError(f"{CONFIG}: model_type {config.get('model_type')!r} is not a Qwen-VL type ({known})")
    tokenizer = folder.get(TOKENIZER_CONFIG)
    if tokenizer is None:
        raise NotPortableError(f"{folder.path} has no {TOKENIZER_CONFIG}")
    edits = [FileEdit(CONFIG, *portable_config(config)),
             FileEdit(TOKENIZER_CONFIG, *portable_tokenizer_config(tokenizer, folder.tokenizer_pipeline))]
    return [edit for edit in edits if edit.changes] + processor_edits(folder)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write beside the target, then rename: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, ensure_ascii=False)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _backup_path(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup, counter = path.with_name(f"{path.name}.bak-{stamp}"), 1
    while backup.exists():
        backup, counter = path.with_name(f"{path.name}.bak-{stamp}-{counter}"), counter + 1
    return backup


def write_edits(folder: str | os.PathLike, edits: list[FileEdit], backup: bool) -> dict[str, Any]:
    """Write the edits (each file atomically); with ``backup`` each replaced file is kept as ``NAME.bak-STAMP``."""
    folder = Path(folder)
    backups = {}
    for edit in edits:
        path = folder / edit.name
        if backup and path.exists():
            backups[edit.name] = str(_backup_path(path))
            shutil.copy2(path, backups[edit.name])
        _write_json(path, edit.data)
    return {"changed": bool(edits), "files": {e.name: e.changes for e in edits}, "backups": backups}


def make_portable(folder: str | os.PathLike, backup: bool = False) -> dict[str, Any]:
    """Put the folder in the portable layout; idempotent (a second call changes nothing)."""
    return write_edits(folder, portable_edits(ModelFolder.load(folder)), backup)
