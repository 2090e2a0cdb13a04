"""What a checkpoint must share with the run that resumes it, compared before anything loads.

A run started into another run's ``output_dir`` resumed its checkpoints unseen: another frame or family trained on
silently (and the output's ``qwenvl_policy.json`` then misdescribed the first steps), another LoRA rank or model size
ended in a torch ``size mismatch``, full fine-tuning on LoRA checkpoints in ``Can't find a checkpoint index``; an
adapter of another family (``adapter_name_or_path``) was trained on in the wrong coordinate convention. A run's
identity is the few settings a resume cannot change; each checkpoint's marker records its run's (``grpo.trainer.resume``), and a
checkpoint written before that is read from its files: ``adapter_config.json`` (rank, base model), ``config.json``,
``qwenvl_policy.json``. The marker also records the launch (model path, adapters, dataset, learning rate, seed): a
relaunched YAML that resumes a checkpoint another launch wrote, in an output_dir another run has since taken, is told
so in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model_type, resolve_family
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import read_policy_record
from llamafactory_qwenvl_patch.grpo.trainer.resume import recorded_run

COORDS = {"model": "absolute pixels of the model input", "rel1000": "relative 0-1000"}
# (the YAML key, its name in a policy record's ``video``)
_VIDEO_KEYS = (("video_min_pixels", "min_pixels"), ("video_max_pixels", "max_pixels"), ("video_fps", "fps"),
               ("video_maxlen", "max_frames"), ("qwenvl_frame_list_fps", "frame_list_fps"))
_FULL = ("full", "freeze")  # a checkpoint of the whole model, read from its files: either of LF's two
_WHEN = ("started", "host")  # the launch settings that only say when and where


class RunMismatchError(ValueError):
    """A checkpoint or adapter of another kind of run than this one."""


def run_identity(model_args: Any, data_args: Any, finetuning_args: Any) -> dict[str, Any]:
    """This run's identity, as a checkpoint's marker records it."""
    from llamafactory_qwenvl_patch.integration.model_patch import frame_list_fps_of, video_policy_of

    family = resolve_family(model_args.model_name_or_path, data_args.template)
    identity: dict[str, Any] = {"stage": finetuning_args.stage, "finetuning_type": finetuning_args.finetuning_type,
                                "family": family.name, "factor": family.factor}
    shape = _model_facts(model_args.model_name_or_path)[1]
    if shape is not None:
        identity["model"] = shape
    if finetuning_args.finetuning_type == "lora":
        identity["lora_rank"] = finetuning_args.lora_rank
        identity["lora_target"] = sorted(finetuning_args.lora_target)
    if not getattr(model_args, "qwenvl_patch", False):
        return {**identity, "qwenvl_patch": False}
    policy = ResizePolicy(model_args.image_min_pixels, model_args.image_max_pixels, family.factor)
    video = video_policy_of(model_args, policy)
    record = {**policy.to_dict(), "video": {**video.to_dict(), "frame_list_fps": frame_list_fps_of(model_args, video)}}
    return {**identity, **_frame(record)}


def folder_identity(folder: str | Path) -> dict[str, Any]:
    """What a checkpoint's or adapter's files tell of the run that wrote them."""
    folder = Path(folder)
    found: dict[str, Any] = {}
    adapter = _json(folder / "adapter_config.json")
    if adapter is not None:
        found.update(finetuning_type="lora", lora_rank=adapter.get("r"))
        base = adapter.get("base_model_name_or_path")
    elif (folder / "config.json").is_file():
        found["finetuning_type"], base = _FULL, str(folder)
    else:
        base = None
    family, shape = _model_facts(base)
    found.update({key: value for key, value in (("family", family), ("model", shape)) if value is not None})
    record = read_policy_record(folder)
    found.update(_frame(record) if record is not None else {"qwenvl_patch": False})
    return found


def check_resume(checkpoint: str, identity: dict[str, Any], explicit: bool) -> None:
    """Refuse to resume ``checkpoint`` when its run differs from this one (``identity``), naming each key."""
    there = {**folder_identity(checkpoint), **(recorded_run(checkpoint) or {})}
    differences = _differences(there, identity, Path(checkpoint).name)
    if not differences:
        return
    chosen = "the resume_from_checkpoint you named" if explicit else "the last complete checkpoint of output_dir"
    raise RunMismatchError(
        f"{checkpoint} ({chosen}) was written by another run than this one: {'; '.join(differences)}. Resuming it "
        "would carry that run's weights and optimizer state on under other settings (a torch size mismatch, or a "
        "silently different run), so this run stops before loading anything. To continue that run, set those keys "
        "back to its values; to start another run, give it another output_dir.")


def launch_settings(model_args: Any, data_args: Any, training_args: Any) -> dict[str, Any]:
    """What tells this launch from another of the same kind, and when and where it started (``_WHEN``): a resume
    may change them, so they are only named (``other_launch``), never refused."""
    import socket
    import time

    values = {"model_name_or_path": model_args.model_name_or_path,
              "adapter_name_or_path": model_args.adapter_name_or_path, "dataset": data_args.dataset,
              "template": data_args.template, "cutoff_len": data_args.cutoff_len,
              "learning_rate": training_args.learning_rate, "seed": training_args.seed,
              "per_device_train_batch_size": training_args.per_device_train_batch_size,
              "gradient_accumulation_steps": training_args.gradient_accumulation_steps}
    config = _config_file()
    if config is not None:
        values["config"] = config
    return {**json.loads(json.dumps(values, default=str)), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "host": socket.gethostname()}


def _config_file() -> str | None:
    """The YAML or JSON file this process was launched with (``llamafactory-cli train FILE``, as LF's ``read_args``
    takes it), by its path and the first 12 hex digits of its SHA-256: a relaunch of another run's file, or of an
    edited one, is told apart even where the keys compared above agree. None when launched without one."""
    import hashlib
    import sys

    if len(sys.argv) < 2 or not sys.argv[1].endswith((".yaml", ".yml", ".json")):
        return None
    path = Path(sys.argv[1]).absolute()
    if not path.is_file():  # a pipe LF has read already would block a second read
        return str(path)
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    except OSError:
        return str(path)
    return f"{path} (sha256 {digest})"


def other_launch(checkpoint: str, launch: dict[str, Any]) -> str | None:
    """One line when ``checkpoint`` was written by a launch with other settings than this one (a relaunched YAML
    into an output_dir another run has since taken continued that run without a word); None when they agree or
    its marker does not say."""
    there = recorded_run(checkpoint, "launch")
    if there is None:
        return None
    differences = [f"{key}: {_show(key, there[key])} there, {_show(key, launch[key])} here"
                   for key in launch if key not in _WHEN and key in there and there[key] != launch[key]]
    if not differences:
        return None
    return (f"resuming {checkpoint}, which a run launched with other settings wrote (started {there.get('started')} "
            f"on {there.get('host')}): {'; '.join(differences)}. This run continues that one; to start it afresh, "
            "give it another output_dir.")


def check_adapters(adapters: list[str] | None, identity: dict[str, Any]) -> None:
    """Refuse an ``adapter_name_or_path`` trained on another family or model size than this run's model: its
    answers use its family's coordinates, and its weights fit only its model."""
    for adapter in adapters or []:
        if not Path(adapter).is_dir():
            continue  # a hub adapter: LF resolves it; nothing here to read
        there = {key: value for key, value in folder_identity(adapter).items() if key in ("family", "model", "factor")}
        differences = _differences(there, identity, "the adapter")
        if differences:
            raise RunMismatchError(
                f"adapter_name_or_path {adapter} was trained on another model than this run's "
                f"{identity.get('family')}: {'; '.join(differences)}. Its answers use its own family's coordinates "
                "and its weights fit only the model it was trained on. Use an adapter trained on this run's model, "
                "or start from the base model.")


def _differences(there: dict[str, Any], here: dict[str, Any], name: str) -> list[str]:
    """``key: value in <name>, value in this run`` for each key both know and disagree on (the frame's factor only
    when ``there`` does not know its family)."""
    keys = [key for key in here if key in there and not (key == "factor" and "family" in there)]
    return [f"{key}: {_show(key, there[key])} in {name}, {_show(key, here[key])} in this run"
            for key in keys if not _same(there[key], here[key])]


def _same(there: Any, here: Any) -> bool:
    return here in there if isinstance(there, tuple) else there == here


def _show(key: str, value: Any) -> str:
    if key == "family" and value in FAMILIES:
        return f"{value} (answers in {COORDS.get(FAMILIES[value].coords, FAMILIES[value].coords)})"
    if isinstance(value, tuple):
        return " or ".join(map(str, value))
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _frame(record: dict[str, Any]) -> dict[str, Any]:
    """A policy record as the YAML keys it comes from."""
    video = record.get("video") or {}
    keys = {"qwenvl_patch": True, "factor": record["factor"], "image_min_pixels": record["min_pixels"],
            "image_max_pixels": record["max_pixels"]}
    keys.update({key: video[name] for key, name in _VIDEO_KEYS if video.get(name) is not None})
    return keys


def _model_facts(name_or_path: str | None) -> tuple[str | None, str | None]:
    """(family, the sizes that decide whether weights fit) of a model's config; (None, None) when it cannot be read
    here (a hub model not in the cache, a folder moved since)."""
    if not name_or_path:
        return None, None
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # LF logs transformers at INFO: each read would print the whole config
    try:
        config = AutoConfig.from_pretrained(name_or_path)
        text = config.get_text_config()
        shape = f"hidden_size {text.hidden_size}, {text.num_hidden_layers} layers, vocab_size {text.vocab_size}"
    except Exception:  # noqa: BLE001 - any config transformers cannot read is one we cannot compare
        return None, None
    finally:
        hf_logging.set_verbosity(verbosity)
    return family_of_model_type(config.model_type), shape


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
