"""``qwenvl-prep fix-config``: check a model folder, and rewrite a nested Qwen-VL ``config.json`` in the flat layout
that transformers <= 4.51 reads.

transformers >= 4.52 writes ``text_config`` as a nested dict (5.x also ``rope_parameters`` and ``dtype``); <= 4.51
loads that nested dict as a plain dict and fails in ``GenerationConfig.from_model_config`` with
``'dict' object has no attribute 'to_dict'``. The flat layout (text keys at the top level, ``rope_scaling`` /
``rope_theta``, ``torch_dtype``) loads in both.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model_type
from llamafactory_qwenvl_patch.frame.policy_record import read_processor_bounds
from qwenvl_prep.atomic import write_json


def nested_only(model_type: str | None) -> bool:
    """A family whose readers have always used the nested layout (Qwen3-VL): there is no flat one to write."""
    family = family_of_model_type(model_type)
    return family is not None and not FAMILIES[family].flat_config


def layout(config: dict[str, Any]) -> str:
    return "nested" if isinstance(config.get("text_config"), dict) else "flat"


def flatten(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The flat layout of a nested config and the list of changes made."""
    out = {k: v for k, v in config.items() if k != "text_config"}
    changes = []
    text = dict(config.get("text_config") or {})
    text.pop("model_type", None)
    for key in ("architectures", "transformers_version"):
        text.pop(key, None)
    rope = text.pop("rope_parameters", None)
    if isinstance(rope, dict):
        rope = dict(rope)
        theta = rope.pop("rope_theta", None)
        if theta is not None:
            text.setdefault("rope_theta", theta)
            changes.append(f"rope_parameters.rope_theta -> rope_theta ({theta})")
        rope_type = rope.get("rope_type", "default")
        if "mrope_section" in rope:
            rope.setdefault("type", "mrope" if rope_type == "default" else rope_type)
            rope["rope_type"] = "mrope" if rope_type == "default" else rope_type
        text.setdefault("rope_scaling", rope)
        changes.append(f"rope_parameters -> rope_scaling ({json.dumps(rope)})")
    for key, value in text.items():
        if key in out and out[key] != value and key != "dtype":
            changes.append(f"kept top-level {key}={out[key]!r} over text_config.{key}={value!r}")
        out.setdefault(key, value)
    dtype = out.pop("dtype", None)
    if dtype is not None:
        out.setdefault("torch_dtype", dtype)
        changes.append(f"dtype -> torch_dtype ({dtype})")
    changes.insert(0, f"moved {len(text)} text_config keys to the top level and removed text_config")
    return out, changes


def inspect_model(model_dir: Path, yaml_bounds: tuple[int, int] | None = None) -> dict[str, Any]:
    """Report on a model folder: layout, sub-config types, transformers versions, processor bounds vs the YAML."""
    import transformers
    from transformers import CONFIG_MAPPING

    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json")
    config = json.loads(path.read_text())
    problems = []
    model_type = config.get("model_type")
    if family_of_model_type(model_type) is None:
        known = ", ".join(prefix for f in FAMILIES.values() for prefix in f.model_types)
        problems.append(f"model_type {model_type!r} is not a Qwen-VL type ({known})")
    sub_types = {}
    for key in ("text_config", "vision_config"):
        sub = config.get(key)
        if isinstance(sub, dict) and sub.get("model_type"):
            sub_types[key] = sub["model_type"]
            if sub["model_type"] not in CONFIG_MAPPING:
                problems.append(f"{key}.model_type {sub['model_type']!r} is unknown to the installed transformers "
                                f"{transformers.__version__}")
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
        "problems": problems,
    }


def rewrite_flat(model_dir: Path) -> dict[str, Any]:
    """Rewrite config.json in the flat layout, keeping a timestamped backup; no-op if already flat."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    if nested_only(config.get("model_type")):
        raise ValueError(f"{config['model_type']} configs are nested in every transformers that supports them; "
                         "there is no flat layout to write")
    if layout(config) == "flat":
        return {"changed": False, "backup": None, "changes": ["already flat: nothing to do"]}
    flat, changes = flatten(config)
    backup = model_dir / f"config.json.bak-{time.strftime('%Y%m%d-%H%M%S')}"
    counter = 1
    while backup.exists():
        backup = model_dir / f"config.json.bak-{time.strftime('%Y%m%d-%H%M%S')}-{counter}"
        counter += 1
    shutil.copy2(path, backup)
    write_json(path, flat)
    return {"changed": True, "backup": str(backup), "changes": changes}
