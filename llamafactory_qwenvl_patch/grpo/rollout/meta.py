"""A record's ``meta`` as the GRPO rewards receive it: ``qwenvl-prep convert`` writes it as JSON text, and the LF glue
(``integration.grpo_meta``) carries it through LF's dataset code in the column ``META_COLUMN``."""

from __future__ import annotations

import json
from typing import Any

META_COLUMN = "grpo_meta"
TASK_COLUMN = "grpo_task"  # the record's aligned prompt messages, system and tools as JSON (agent runs render them)


def decode_meta(text: str | None) -> Any:
    """The record's ``meta``: parsed JSON when it is JSON text, the text itself otherwise, None when absent."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text
