"""What LLaMA-Factory 0.9.5 loads from a dataset: a record as its converter reads it under a ``dataset_info.json``
entry, and the records it would drop or fail on.

``convert`` never writes a record that LF drops (``Invalid role tag``, ``Invalid message count``) or fails on (image
or video tags that do not match the images or videos, ``<audio>`` tags, Qwen-VL's own chat and media tokens written in
its text); ``check``, ``eval``, ``draw`` and ``predict`` read a dataset
through its entry's ``formatting``, ``columns`` and ``tags`` exactly as LF does (``data/parser.py`` DatasetAttr,
``data/converter.py``), and report the same records.
"""

from __future__ import annotations

from typing import Any, Callable

from llamafactory_qwenvl_patch.frame.families import structure_token_in

USER_SIDE = ("user", "observation")  # LF's odd turns
MODEL_SIDE = ("assistant", "function_call")  # LF's even turns
NOT_CARRIED = ("chosen", "rejected", "kto_tag", "audios")  # preference data, audio
OTHER_MEDIA_TAGS = ("<audio>",)
IMAGE_TAG = "<image>"
MEDIA = ((IMAGE_TAG, "images", "image"), ("<video>", "videos", "video"))  # (tag, column, noun)

# DatasetAttr's defaults: they apply when an entry has no "columns" (or no "tags") at all; an entry that has one
# gets None for every key it leaves out
_DEFAULT_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": None,
                    "messages": "conversations", "system": None, "tools": None, "images": None, "videos": None}
_DEFAULT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'aeio' else 'a'} {word}"  # a user, an assistant


def special_token_problem(text: str) -> str | None:
    """Why ``text`` cannot stand in a record or a prompt, to follow "holds": one of Qwen-VL's chat-template or
    media tokens (``families.STRUCTURE_TOKENS``), which the tokenizer reads as the token itself; None when it holds
    none."""
    token = structure_token_in(text)
    if token is None:
        return None
    return (f"{token}, one of Qwen-VL's own special tokens, which the tokenizer reads as the token itself, not as "
            "text (an image or video pad is counted as a media item that is not there: predict stops with an "
            "IndexError, training with a token mismatch; a turn or text end cuts the record); remove it or write it "
            "otherwise")


def record_problem(record: dict[str, Any]) -> str | None:
    """Why LF would drop or refuse a canonical record (``{"messages": [{"role", "content"}], "images": [...]}``, and
    ``"videos"`` when it has any), None when it loads it. Roles: an optional system turn first, then user or
    observation turns and assistant or function_call turns alternating, ending with a model turn; ``<image>`` and
    ``<video>`` tags only in user and observation turns, one per image or video."""
    messages = record["messages"]
    turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
    for position, turn in enumerate(turns):
        expected = USER_SIDE if position % 2 == 0 else MODEL_SIDE
        if turn["role"] not in expected:
            where = "starts with" if position == 0 else f"has at turn {position + 1 + len(messages) - len(turns)}"
            return (f"the record {where} {_a(turn['role'])} turn where LLaMA-Factory expects "
                    f"{' or '.join(expected)} (a system turn only first, then user and assistant turns alternating); "
                    "LF would drop it")
    if len(turns) % 2 or not turns:
        return (f"the record ends with {_a(turns[-1]['role'] if turns else 'system')} turn: LLaMA-Factory needs a "
                "final assistant (or function_call) turn to train on and would drop it")
    for m in messages:
        if (problem := special_token_problem(m["content"])) is not None:
            return f"its {m['role']} turn holds {problem}"
    for tag in OTHER_MEDIA_TAGS:
        if any(tag in m["content"] for m in messages):
            return (f"the record has a {tag} tag: convert carries images and videos only, and LF fails on a tag "
                    "without media")
    for tag, column, noun in MEDIA:
        misplaced = sorted({m["role"] for m in messages if m["role"] not in USER_SIDE and tag in m["content"]})
        if misplaced:
            return (f"{_a(noun).split()[0]} {tag} tag in {_a(' and '.join(misplaced))} turn: LLaMA-Factory would "
                    f"expand it into {noun} tokens there; tags belong in user (or observation) turns")
        tags = sum(m["content"].count(tag) for m in messages)
        if tags != len(record.get(column) or []):
            return (f"the record has {len(record.get(column) or [])} {noun}(s) but {tags} {tag} tag(s) in its user "
                    f"turns; LLaMA-Factory needs one tag per {noun}")
    return None


def images_of_turns(texts: list[str], has_coords: list[bool], count: int) -> list[int]:
    """For each turn (its text, and whether it holds coordinates), the index of the image its coordinates are on:
    the only one of a single-image record; in a record of ``count`` images (an agent's trajectory, a screenshot a
    turn), the image of the last turn that showed one, at or before it. ValueError for coordinates before any image,
    or after a turn that showed several (which one is unknown)."""
    if count == 1:
        return [0] * len(texts)
    shown, last_tags, out = 0, 0, []
    for position, (text, coords) in enumerate(zip(texts, has_coords), start=1):
        tags = text.count(IMAGE_TAG)
        shown += tags
        last_tags = tags or last_tags
        if coords and shown == 0:
            raise ValueError(f"turn {position} has coordinates before any image is shown: in a record of {count} "
                             "images, coordinates are on the image of the last turn that showed one")
        if coords and last_tags > 1:
            raise ValueError(f"turn {position} has coordinates after a turn that shows {last_tags} images: which "
                             "image they are on is unknown (a record of several images takes coordinates after a "
                             "turn that shows one)")
        out.append(shown - 1)
    return out


def not_carried(raw: dict[str, Any]) -> str | None:
    """Why convert refuses a raw record it would otherwise lose part of (never silently dropped)."""
    present = [key for key in NOT_CARRIED if raw.get(key) not in (None, "", [])]
    if not present:
        return None
    return (f"the record has {', '.join(repr(k) for k in present)}, which convert does not carry (it writes "
            "supervised conversations with images and videos); convert preference or audio data another way")


class EntryError(ValueError):
    """A ``dataset_info.json`` entry whose layout ``check`` cannot read as LF does."""


def entry_reader(entry: dict[str, Any]) -> tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]:
    """(our reader's format, a function that renames a raw record's keys as LF reads it under ``entry``). LF gives
    every column or tag that an entry's ``columns`` / ``tags`` leave out the value None: a column it does not map
    is not read at all (images without an ``images`` column are not loaded)."""
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("sharegpt", "alpaca") or entry.get("ranking"):
        raise EntryError(f"formatting {formatting!r}{' with ranking' if entry.get('ranking') else ''} is not "
                         "checked (check reads supervised sharegpt and alpaca entries)")
    columns = {k: entry["columns"].get(k) for k in _DEFAULT_COLUMNS} if "columns" in entry else _DEFAULT_COLUMNS
    tags = {k: entry["tags"].get(k) for k in _DEFAULT_TAGS} if "tags" in entry else _DEFAULT_TAGS
    common = {"images": columns["images"], "videos": columns["videos"], "system": columns["system"],
              "tools": columns["tools"]}

    def pick(raw: dict[str, Any], names: dict[str, str | None]) -> dict[str, Any]:
        return {ours: raw.get(theirs) for ours, theirs in names.items() if theirs and raw.get(theirs) is not None}

    if formatting == "alpaca":
        names = {"instruction": columns["prompt"], "input": columns["query"], "output": columns["response"],
                 "history": columns["history"], **common}
        return "alpaca", lambda raw: pick(raw, names)
    roles = {tags[f"{side}_tag"]: side for side in ("user", "assistant", "observation", "system")
             if tags[f"{side}_tag"] is not None}
    if tags["function_tag"] is not None:
        roles[tags["function_tag"]] = "function_call"

    def sharegpt(raw: dict[str, Any]) -> dict[str, Any]:
        turns = raw.get(columns["messages"]) if columns["messages"] else None
        if isinstance(turns, list):
            turns = [{"role": roles.get(t.get(tags["role_tag"]), repr(t.get(tags["role_tag"]))),
                      "content": t.get(tags["content_tag"])} if isinstance(t, dict) else t for t in turns]
        return {**pick(raw, common), "messages": turns}

    return "sharegpt", sharegpt
