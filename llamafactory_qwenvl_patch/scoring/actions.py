"""GUI-agent actions in a model's answer (pure functions), read by the one answer parser as boxes are (``answers``:
bare, fenced or embedded in prose, read as written, the point through ``answers.read_coords``):

``{"action": "click", "point_2d": [x, y]}``, ``{"action": "type", "text": "..."}``,
``{"action": "scroll", "point_2d": [x, y], "direction": "down"}``, ``{"action": "key", "key": "enter"}``,
``{"action": "done"}``.

A point stays in the answer's frame (the family's convention); ``agent.frame`` checks it there and maps it to the
screen's pixels. Anything that is not exactly one well-formed action is an AnswerError whose message is the reason
the agent's turn is ``invalid``: a guess would teach the model the wrong format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llamafactory_qwenvl_patch.scoring.answers import AnswerError, json_values, read_coords

ACTION_KEY = "action"
ACTION_KINDS = ("click", "type", "scroll", "key", "done")
POINTED = ("click", "scroll")  # the kinds that carry a point_2d
DIRECTIONS = ("up", "down", "left", "right")
FORMAT = '{"action": ...} JSON'
# Text that must be read as an action: a quoted "action" key (the bare word is prose)
_ACTION_TEXT = re.compile(r"[\"']action[\"']\s*:")


@dataclass(frozen=True)
class ParsedAction:
    """One action as the model wrote it: ``point`` in the answer's own frame (None for type, key and done)."""

    kind: str
    point: tuple[float, float] | None = None
    text: str | None = None
    direction: str | None = None
    key: str | None = None


def _is_action(value: Any) -> bool:
    return isinstance(value, dict) and ACTION_KEY in value


def _word(obj: dict, key: str, kind: str) -> str:
    """A non-empty string field of an action (``text``, ``key``, ``direction``)."""
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise AnswerError(f"a {kind} action needs a non-empty string {key!r}, got {value!r}")
    try:
        value.encode("utf-8")  # JSON's "\ud800" escape reads as a lone surrogate: no text an environment can type
    except UnicodeEncodeError as exc:
        raise AnswerError(f"a {kind} action's {key!r} is not text ({exc.reason} at character {exc.start})") from None
    return value


def _read(obj: dict) -> ParsedAction:
    kind = obj[ACTION_KEY]
    name = kind.strip().lower() if isinstance(kind, str) else None
    if name not in ACTION_KINDS:
        raise AnswerError(f"action {kind!r} is not one of {', '.join(ACTION_KINDS)}")
    point = None
    if name in POINTED:
        if "point_2d" not in obj:
            raise AnswerError(f"a {name} action needs a point_2d [x, y]")
        x, y = read_coords("point_2d", obj["point_2d"])
        point = (x, y)
    direction = _word(obj, "direction", name).strip().lower() if name == "scroll" else None
    if direction is not None and direction not in DIRECTIONS:
        raise AnswerError(f"scroll direction {obj['direction']!r} is not one of {', '.join(DIRECTIONS)}")
    return ParsedAction(name, point, _word(obj, "text", name) if name == "type" else None, direction,
                        _word(obj, "key", name) if name == "key" else None)


def parse_action(text: str) -> ParsedAction:
    """The one action of an answer; AnswerError (the reason) when there is none, more than one, or it is malformed:
    an unknown kind, a missing, non-finite or wrongly sized point, a missing text, key or direction."""
    values = json_values(text, _is_action, _ACTION_TEXT, FORMAT)
    if not values:
        raise AnswerError(f"no action in the answer: expected {FORMAT}, e.g. "
                          '{"action": "click", "point_2d": [x, y]}')
    if len(values) > 1:
        raise AnswerError(f"{len(values)} actions in one answer; a turn takes exactly one")
    return _read(values[0])
