"""Verifiable rewards (pure functions) and the loader for ``reward_funcs``.

The reward API: ``fn(completions, *, references, prompts, orig_sizes, model_sizes, resize_policy, indices, coords)
-> list[float]`` with one entry per completion. ``references`` is the dataset's last assistant turn and ``prompts``
the prompt as the model read it (special tokens kept, each image's pads shown once); ``orig_sizes`` and
``model_sizes`` are (height, width) of the first image, the latter read from ``image_grid_thw`` (what the model
really saw); ``resize_policy`` is the run's ResizePolicy; ``indices`` are dataset indices; ``coords`` is the
convention the model answers in (``model`` for Qwen2.5-VL, ``rel1000`` for Qwen2-VL and Qwen3-VL). Built-ins never
raise on garbage; a custom reward that raises or returns NaN scores 0 for the completions concerned (the batch is
scored again one completion at a time to find them), and each is counted.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import re
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from llamafactory_qwenvl_patch.answers import AnswerError, parse_items
from llamafactory_qwenvl_patch.metrics import match_boxes

RewardFunc = Callable[..., list[float]]
_FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL)


def _boxes(text: str) -> list[tuple[float, ...]] | None:
    try:
        return [item.coords for item in parse_items(text) if item.kind == "bbox_2d"]
    except AnswerError:
        return None


def iou_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """Continuous IoU in [0, 1]: boxes matched one-to-one, summed IoU over max(#truth, #predicted)."""
    out = []
    for completion, reference in zip(completions, references):
        truth, predicted = _boxes(reference) or [], _boxes(completion) or []
        if not truth or not predicted:
            out.append(0.0)
            continue
        total = sum(score for _, _, score in match_boxes(truth, predicted))
        out.append(total / max(len(truth), len(predicted)))
    return out


def _json_object(text: str) -> Any:
    fence = _FENCE.search(text)
    body = (fence.group(1) if fence else text).strip()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, ValueError):
        return None


def format_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """1 when the answer parses into the reference's structure: grounding items, a JSON object, or any text."""
    out = []
    for completion, reference in zip(completions, references):
        try:
            ref_items = parse_items(reference)
        except AnswerError:
            ref_items = []
        if ref_items:
            try:
                items = parse_items(completion)
            except AnswerError:
                items = []
            kinds = {item.kind for item in ref_items}
            out.append(1.0 if items and {item.kind for item in items} <= kinds else 0.0)
        elif isinstance(_json_object(reference), dict):
            out.append(1.0 if isinstance(_json_object(completion), dict) else 0.0)
        else:
            out.append(1.0 if completion.strip() else 0.0)
    return out


def normalize(text: Any) -> str:
    """Case-, width- and whitespace-insensitive form for exact matching (code fences and end punctuation dropped)."""
    text = unicodedata.normalize("NFKC", str(text))
    fence = _FENCE.search(text)
    text = fence.group(1) if fence else text
    return " ".join(text.casefold().split()).strip(" .;,")


def json_fields_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """Partial credit per field of the reference JSON object (invoice number, date, amount, ...)."""
    out = []
    for completion, reference in zip(completions, references):
        truth, answer = _json_object(reference), _json_object(completion)
        if not isinstance(truth, dict) or not truth or not isinstance(answer, dict):
            out.append(0.0)
            continue
        hits = sum(1 for key, value in truth.items() if key in answer and normalize(answer[key]) == normalize(value))
        out.append(hits / len(truth))
    return out


def accuracy_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """1 for a normalised exact match with the reference answer."""
    return [1.0 if normalize(c) == normalize(r) else 0.0 for c, r in zip(completions, references)]


BUILTIN: dict[str, RewardFunc] = {
    "iou": iou_reward,
    "format": format_reward,
    "json_fields": json_fields_reward,
    "accuracy": accuracy_reward,
}


def load_reward(spec: str) -> tuple[str, RewardFunc]:
    """A built-in name, ``package.module:function`` or ``path/to/file.py:function``."""
    spec = spec.strip()
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: not a built-in ({', '.join(BUILTIN)}) and not module:function")
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"reward {spec!r}: file {path} not found")
        module_spec = importlib.util.spec_from_file_location(f"qwenvl_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"reward {spec!r}: cannot import {target} ({exc})") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise ValueError(f"reward {spec!r}: {target} has no function {name}")
    return name, func


@dataclass(frozen=True)
class Reward:
    name: str
    func: RewardFunc
    weight: float
    accepts: frozenset[str] | None = None  # keywords it takes; None: any (it has **kwargs; it also gets ``policy``)

    @property
    def legacy_policy(self) -> bool:
        """It names the keyword ``policy``, now ``resize_policy``."""
        return self.accepts is not None and "policy" in self.accepts


def _keywords(func: RewardFunc) -> frozenset[str] | None:
    """The keywords ``func`` accepts, so rewards written for fewer keywords keep working as keywords are added."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def load_rewards(funcs: str, weights: str | None) -> list[Reward]:
    specs = [s for s in (funcs or "").split(",") if s.strip()]
    if not specs:
        raise ValueError("stage: grpo needs reward_funcs, e.g. `reward_funcs: iou,format`")
    values = [float(w) for w in weights.split(",")] if weights else [1.0] * len(specs)
    if len(values) != len(specs):
        raise ValueError(f"reward_weights has {len(values)} values for {len(specs)} reward_funcs")
    rewards = []
    for spec, weight in zip(specs, values):
        name, func = load_reward(spec)
        reward = Reward(name, func, weight, _keywords(func))
        if reward.legacy_policy:
            warnings.warn(f"reward {name!r} takes the keyword `policy`, renamed `resize_policy` (in GRPO code "
                          "'policy' means the model being trained); it still receives it for now", FutureWarning,
                          stacklevel=2)
        rewards.append(reward)
    return rewards


def _call(reward: Reward, completions: list[str], columns: dict[str, list], shared: dict[str, Any]) -> list[float]:
    kwargs = {**columns, **shared, "policy": shared["resize_policy"]}  # ``policy``: the pre-rename keyword
    if reward.accepts is not None:
        kwargs = {key: value for key, value in kwargs.items() if key in reward.accepts}
    values = [float(v) for v in reward.func(completions, **kwargs)]
    if len(values) != len(completions):
        raise ValueError(f"returned {len(values)} rewards for {len(completions)} completions")
    return values


def score(reward: Reward, completions: list[str], columns: dict[str, list], shared: dict[str, Any]
          ) -> tuple[list[float], list[bool]]:
    """(values, error flags): a raising reward is called again per completion, so only the completions that make
    it fail (or give NaN / inf) score 0 and are counted. ``columns`` hold one entry per completion."""
    try:
        values = _call(reward, completions, columns, shared)
    except Exception:  # noqa: BLE001 - a user reward must never stop training
        values = []
        for i, completion in enumerate(completions):
            try:
                values += _call(reward, [completion], {k: v[i:i + 1] for k, v in columns.items()}, shared)
            except Exception:  # noqa: BLE001
                values.append(math.nan)
    errors = [not math.isfinite(v) for v in values]
    return [0.0 if bad else v for v, bad in zip(values, errors)], errors
