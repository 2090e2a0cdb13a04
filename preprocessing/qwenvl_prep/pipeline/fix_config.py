"""``qwenvl-prep fix-config``: check a model folder against every reader (transformers 4.49 to 4.57, vLLM 0.11 and
0.28 on), repair it into the portable layout for a target reader, or rewrite a nested ``config.json`` flat.

The layouts and rules live in ``llamafactory_qwenvl_patch.model_files`` (the export under ``qwenvl_patch: true``
writes the same portable layout); this module is the command's side: reports, backups, refusals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model_type
from llamafactory_qwenvl_patch.frame.policy_record import read_processor_bounds
from llamafactory_qwenvl_patch.model_files.config_layout import check_text_config, flatten, layout, nested_only
from llamafactory_qwenvl_patch.model_files.folder import FileEdit, ModelFolder, NotPortableError
from llamafactory_qwenvl_patch.model_files.portable import portable_edits, write_edits
from llamafactory_qwenvl_patch.model_files.readers import READERS, all_reader_problems, reader_problems, resolve_reader


def inspect_model(model_dir: Path, yaml_bounds: tuple[int, int] | None = None) -> dict[str, Any]:
    """Report on a model folder: layout, sub-config types, transformers versions, processor bounds vs the YAML, and
    what each reader cannot load (``readers``)."""
    import transformers

    folder = ModelFolder.load(model_dir)  # every JSON file read once, as an object, or an error naming it
    config = folder.get("config.json")
    if config is None:
        raise ValueError(f"{model_dir} has no config.json")
    problems = []
    model_type = config.get("model_type")
    if family_of_model_type(model_type) is None:
        known = ", ".join(prefix for f in FAMILIES.values() for prefix in f.model_types)
        problems.append(f"model_type {model_type!r} is not a Qwen-VL type ({known})")
    # sub-config types are not looked up in CONFIG_MAPPING: 4.57 has no ``qwen2_5_vl_vision`` there yet loads it
    sub_types = {key: config[key]["model_type"] for key in ("text_config", "vision_config")
                 if isinstance(config.get(key), dict) and config[key].get("model_type")}
    problems += [f"config.json: {key} is {json.dumps(config[key])[:60]}, not an object"
                 for key in ("text_config", "vision_config") if key in config and not isinstance(config[key], dict)]
    bounds = read_processor_bounds(model_dir)
    if yaml_bounds is not None and bounds is not None and tuple(bounds) != tuple(yaml_bounds):
        problems.append(f"processor bounds {bounds[0]}..{bounds[1]} differ from the training YAML's "
                        f"{yaml_bounds[0]}..{yaml_bounds[1]}: inference would see another frame than training")
    if bounds is None:
        problems.append("no processor config with image bounds (preprocessor_config.json / processor_config.json)")
    return {
        "model_dir": str(model_dir),
        "model_type": model_type,
        "layout": layout(config),
        "sub_config_types": sub_types,
        "transformers_written": config.get("transformers_version"),
        "transformers_installed": transformers.__version__,
        "processor_bounds": list(bounds) if bounds else None,
        "yaml_bounds": list(yaml_bounds) if yaml_bounds else None,
        "readable_by_transformers_le_4_51": layout(config) == "flat" or nested_only(model_type),
        "readers": all_reader_problems(folder),
        "problems": problems,
    }


def rewrite_flat(model_dir: Path) -> dict[str, Any]:
    """Rewrite config.json in the flat layout, keeping a timestamped backup; no-op if already flat."""
    config = ModelFolder.load(model_dir).get("config.json")
    if config is None:
        raise ValueError(f"{model_dir} has no config.json")
    check_text_config(config)
    if nested_only(config.get("model_type")):
        raise ValueError(f"{config['model_type']} configs are nested in every transformers that supports them; "
                         "there is no flat layout to write")
    if layout(config) == "flat":
        return {"changed": False, "backup": None, "changes": ["already flat: nothing to do"]}
    flat, changes = flatten(config)
    written = write_edits(model_dir, [FileEdit("config.json", flat, changes)], backup=True)
    return {"changed": True, "backup": written["backups"]["config.json"], "changes": changes}


def repair_for(model_dir: Path, target: str, dry_run: bool = False) -> dict[str, Any]:
    """Put the folder in the portable layout so that ``target`` (a READERS key, ``vllm`` for the installed vLLM or
    ``vllm-X.Y``) loads it in the training frame;
    every replaced file is kept as ``NAME.bak-STAMP``. Refused, with nothing written, when the repaired folder would
    still not load in ``target`` (the message lists why) or when a file cannot be repaired safely."""
    target = resolve_reader(target)
    try:
        folder = ModelFolder.load(model_dir)
        edits = portable_edits(folder)
    except NotPortableError as exc:
        raise ValueError(f"cannot repair {model_dir} for {READERS[target]}: {exc}") from None
    remaining = reader_problems(folder.with_edits(edits), target)
    if remaining:
        raise ValueError(f"cannot repair {model_dir} for {READERS[target]}: " + "; ".join(remaining))
    if dry_run:
        return {"target": target, "changed": False, "would_change": {e.name: e.changes for e in edits}}
    return {"target": target, **write_edits(model_dir, edits, backup=True)}
