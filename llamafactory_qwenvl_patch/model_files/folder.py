"""A model folder's reader-relevant files, read once into memory, so that repairs can be planned and their result
checked before anything is written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from llamafactory_qwenvl_patch.frame.policy_record import read_policy_record

CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"
IMAGE_PROCESSOR = "preprocessor_config.json"
PROCESSOR = "processor_config.json"
VIDEO_PROCESSOR = "video_preprocessor_config.json"
JSON_FILES = (CONFIG, TOKENIZER_CONFIG, IMAGE_PROCESSOR, PROCESSOR, VIDEO_PROCESSOR)
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class NotPortableError(ValueError):
    """A folder the portable layout cannot be written for (the message names the file and key)."""


@dataclass
class FileEdit:
    name: str
    data: dict[str, Any]
    changes: list[str] = field(default_factory=list)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, None when absent; unreadable or not an object is a NotPortableError naming it."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotPortableError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise NotPortableError(f"{path}: a JSON object was expected, found {type(data).__name__}")
    return data


@dataclass(frozen=True)
class ModelFolder:
    """The files every reader's loading depends on: the JSON configs, the tokenizer pipeline (normaliser and
    pre-tokenizer of ``tokenizer.json``), whether a chat template exists, and the policy record."""

    path: Path
    files: dict[str, dict[str, Any] | None]
    tokenizer_pipeline: dict[str, Any] | None
    chat_template: bool
    record: dict[str, Any] | None

    @classmethod
    def load(cls, path: str | Path) -> "ModelFolder":
        path = Path(path)
        if not path.is_dir():
            raise NotPortableError(f"{path} is not a model folder")
        files = {name: read_json(path / name) for name in JSON_FILES}
        tokenizer = read_json(path / TOKENIZER_FILE)
        pipeline = None if tokenizer is None else {k: tokenizer.get(k) for k in ("normalizer", "pre_tokenizer")}
        template = (any((path / name).is_file() for name in CHAT_TEMPLATE_FILES)
                    or (path / "additional_chat_templates").is_dir()
                    or bool((files[TOKENIZER_CONFIG] or {}).get("chat_template")))
        try:
            record = read_policy_record(path)
        except ValueError as exc:
            raise NotPortableError(str(exc)) from None
        return cls(path, files, pipeline, template, record)

    def get(self, name: str) -> dict[str, Any] | None:
        return self.files.get(name)

    def with_edits(self, edits: Iterable[FileEdit]) -> "ModelFolder":
        """The folder as it will be once the edits are written."""
        return replace(self, files={**self.files, **{edit.name: edit.data for edit in edits}})

    def record_bounds(self) -> tuple[int, int] | None:
        if self.record is None:
            return None
        return int(self.record["min_pixels"]), int(self.record["max_pixels"])
