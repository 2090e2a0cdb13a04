"""Verifiable rewards (pure functions; the video ones in ``video_rewards``) and the loader for ``reward_funcs``.

The reward API: ``fn(completions, *, references, prompts, orig_sizes, model_sizes, resize_policy, indices, metas,
coords, completion_lengths, max_completion_length, overlong_buffer) -> list[float]``, one entry per completion;
``reward_inputs`` builds the keywords and docs/grpo.md ("Your own reward") says what each holds. Built-ins never raise on garbage; a custom reward that raises or returns
NaN scores 0 for the completions concerned (found by scoring the batch again one completion at a time), and each is
counted.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import time
import traceback
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from llamafactory_qwenvl_patch.frame.policy import PolicyError, frame_extent, map_coords
from llamafactory_qwenvl_patch.grpo.length_rewards import overlong_reward
from llamafactory_qwenvl_patch.grpo.video_rewards import VIDEO_REWARDS, video_format_ok
from llamafactory_qwenvl_patch.scoring.answers import not_present, try_parse_items
from llamafactory_qwenvl_patch.scoring.cheats import CheatRules, cheats
from llamafactory_qwenvl_patch.scoring.clicks import click_dense_score, click_hit, click_point, truth_box
from llamafactory_qwenvl_patch.scoring.detection import detection_f1, detections, sanity_penalty
from llamafactory_qwenvl_patch.scoring.fields import (
    FieldScore, confident, find_json, normalize, reference_value, score_fields,
)
from llamafactory_qwenvl_patch.scoring.metrics import match_boxes
from llamafactory_qwenvl_patch.scoring.temporal import reference_kind

RewardFunc = Callable[..., list[float]]


def _parsed(text: str) -> list:
    return try_parse_items(text) or []


def _boxes(text: str) -> list[tuple[float, ...]]:
    return [item.coords for item in _parsed(text) if item.kind == "bbox_2d"]


def iou_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """Continuous IoU in [0, 1]: boxes matched one-to-one, summed IoU over max(#truth, #predicted). A reference that
    finds nothing (``[]``: the category is absent) scores 1 for an answer that is ``[]`` too, else 0."""
    out = []
    for completion, reference in zip(completions, references):
        truth, predicted = _boxes(reference), _boxes(completion)
        if not_present(reference):
            out.append(1.0 if not_present(completion) else 0.0)
            continue
        if not truth or not predicted:
            out.append(0.0)
            continue
        total = sum(score for _, _, score in match_boxes(truth, predicted))
        out.append(total / max(len(truth), len(predicted)))
    return out


def format_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """1 when the answer parses into the reference's structure: a span or a track for a video reference
    (``video_format_ok``); grounding items (or ``[]`` when the reference is ``[]``, nothing found); for a JSON
    object or array, exactly one JSON value of its type (bare or in one code fence, no prose around it); else any
    text."""
    out = []
    for completion, reference in zip(completions, references):
        if (kind := reference_kind(reference)) is not None:
            out.append(1.0 if video_format_ok(completion, kind) else 0.0)
        elif not_present(reference):
            out.append(1.0 if not_present(completion) or {i.kind for i in _parsed(completion)} == {"bbox_2d"} else 0.0)
        elif ref_items := _parsed(reference):
            items = _parsed(completion)
            kinds = {item.kind for item in ref_items}
            out.append(1.0 if items and {item.kind for item in items} <= kinds else 0.0)
        elif (truth := reference_value(reference)) is not None:
            out.append(1.0 if score_fields(completion, truth).format_ok else 0.0)
        else:
            out.append(1.0 if completion.strip() else 0.0)
    return out


def _field_scores(completions: Sequence[str], references: Sequence[str]) -> list[FieldScore | None]:
    return [score_fields(c, truth) if (truth := reference_value(r)) is not None else None
            for c, r in zip(completions, references)]


def fields_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """Partial credit per field, normalised to [0, 1] (0.3 filled + 0.7 equal per reference leaf, + 1 for an answer
    that is exactly one JSON value, divided by the maximum), so that a record with many fields weighs as much as one
    with few next to the other rewards. 0 when the reference is not a JSON object or array."""
    return [score.normalised if score else 0.0 for score in _field_scores(completions, references)]


def fields_raw_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """The same credit unnormalised, in [0, leaves + 1]: list it with weight 0 to log it."""
    return [score.raw if score else 0.0 for score in _field_scores(completions, references)]


def json_fields_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """Share of the reference object's top-level fields answered exactly (no partial credit; see ``fields``)."""
    out = []
    for completion, reference in zip(completions, references):
        truth, found = reference_value(reference), find_json(completion)
        answer = found[0] if found else None
        if not isinstance(truth, dict) or not isinstance(answer, dict):
            out.append(0.0)
            continue
        hits = sum(1 for key, value in truth.items() if key in answer and normalize(answer[key]) == normalize(value))
        out.append(hits / len(truth))
    return out


def no_cheat_reward(completions: Sequence[str], *, references: Sequence[str], prompts: Sequence[str] | None = None,
                    rules: CheatRules = CheatRules(), **_: Any) -> list[float]:
    """-1 for an answer showing a reward hack (``cheats.cheats``: too short, all fields empty, none of the
    reference's keys, repetition, a copy of the prompt), else 0. Never positive: honest answers are untouched."""
    prompts = prompts or [""] * len(completions)
    return [-1.0 if cheats(c, r, p, rules) else 0.0 for c, r, p in zip(completions, references, prompts)]


def confident_answer(answer: str, reference: str) -> bool:
    """The answer commits to content of the reference's kind: a box or point for grounding, a filled field for
    field extraction, any text otherwise. On a blank image such an answer is a guess."""
    if _parsed(reference):
        return bool(_parsed(answer))
    truth = reference_value(reference)
    return confident(answer, truth) if truth is not None else bool(answer.strip())


def accuracy_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """1 for a normalised exact match with the reference answer."""
    return [1.0 if normalize(c) == normalize(r) else 0.0 for c, r in zip(completions, references)]


def _frame(coords: str, orig_hw: Any, model_hw: Any) -> tuple[Callable | None, tuple[float, float] | None]:
    """(original pixels -> the answer's frame, the frame's extent) for one completion; (None, None) when the sizes
    are unknown (a text-only record)."""
    if orig_hw is None or model_hw is None:
        return None, None
    return partial(map_coords, src="orig", dst=coords, orig_hw=orig_hw, model_hw=model_hw), frame_extent(
        coords, orig_hw, model_hw)


def _click_scores(completions: Sequence[str], references: Sequence[str], metas: Sequence[Any] | None,
                  orig_sizes: Sequence[Any] | None, model_sizes: Sequence[Any] | None, coords: str,
                  scorer: Callable[[tuple[float, float], Sequence[float]], float]) -> list[float]:
    n = len(completions)
    metas, orig_sizes, model_sizes = metas or [None] * n, orig_sizes or [None] * n, model_sizes or [None] * n
    out = []
    for completion, reference, meta, orig_hw, model_hw in zip(completions, references, metas, orig_sizes,
                                                             model_sizes):
        from_orig, _ = _frame(coords, orig_hw, model_hw)
        try:
            box = truth_box(reference, meta, from_orig)
        except PolicyError:
            box = None
        point = click_point(completion)
        out.append(scorer(point, box) if point is not None and box is not None else 0.0)
    return out


def click_reward(completions: Sequence[str], *, references: Sequence[str], metas: Sequence[Any] | None = None,
                 orig_sizes: Sequence[Any] | None = None, model_sizes: Sequence[Any] | None = None,
                 coords: str = "model", **_: Any) -> list[float]:
    """1 when the answer's click (its first point, or its first box's centre) lies in the truth box, else 0. The
    truth box is the record's ``meta.bbox_orig`` (original pixels, mapped into this sample's model frame) or the
    reference's first box."""
    return _click_scores(completions, references, metas, orig_sizes, model_sizes, coords,
                         lambda point, box: float(click_hit(point, box)))


def click_dense_reward(completions: Sequence[str], *, references: Sequence[str], metas: Sequence[Any] | None = None,
                       orig_sizes: Sequence[Any] | None = None, model_sizes: Sequence[Any] | None = None,
                       coords: str = "model", **_: Any) -> list[float]:
    """1 inside the truth box, a Gaussian of the distance in box sizes outside it (``clicks.click_dense_score``)."""
    return _click_scores(completions, references, metas, orig_sizes, model_sizes, coords, click_dense_score)


def det_f1_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """F1 of the answer's boxes against the reference's at IoU >= 0.5, one-to-one and label-aware (labels must
    agree when the reference has them); on a "not present" reference ``[]``, 1 for an empty list and 0 for anything
    else; 0 for malformed coordinates."""
    out = []
    for completion, reference in zip(completions, references):
        truth, predicted = detections(reference) or [], detections(completion)
        if not truth:  # "not present": only an empty list answers it (prose or silence is not an answer)
            out.append(1.0 if not_present(completion) else 0.0)
        else:
            out.append(0.0 if predicted is None else detection_f1(truth, predicted))
    return out


def box_sanity_reward(completions: Sequence[str], *, references: Sequence[str], orig_sizes: Sequence[Any] | None = None,
                      model_sizes: Sequence[Any] | None = None, coords: str = "model", **_: Any) -> list[float]:
    """-1/3 for each detection hack the answer shows (a whole-image box where the truth has none that large, more
    than twice the truth's boxes, duplicate boxes), in [-1, 0]. Never positive: honest answers are untouched."""
    n = len(completions)
    orig_sizes, model_sizes = orig_sizes or [None] * n, model_sizes or [None] * n
    out = []
    for completion, reference, orig_hw, model_hw in zip(completions, references, orig_sizes, model_sizes):
        _, extent = _frame(coords, orig_hw, model_hw)
        predicted = detections(completion)
        out.append(sanity_penalty(detections(reference) or [], predicted or [], extent or (0.0, 0.0)))
    return out


BUILTIN: dict[str, RewardFunc] = {
    "iou": iou_reward,
    "format": format_reward,
    "json_fields": json_fields_reward,
    "fields": fields_reward,
    "fields_raw": fields_raw_reward,
    "no_cheat": no_cheat_reward,
    "accuracy": accuracy_reward,
    "click": click_reward,
    "click_dense": click_dense_reward,
    "det_f1": det_f1_reward,
    "box_sanity": box_sanity_reward,
    "overlong": overlong_reward,
    **VIDEO_REWARDS,
}


def load_reward(spec: str) -> tuple[str, RewardFunc]:
    """A built-in name, ``package.module:function`` or ``path/to/file.py:function``."""
    spec = spec.strip()
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: not a built-in ({', '.join(BUILTIN)}) and not module:function")
    target, name = spec.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ValueError(f"reward {spec!r}: file {path} not found")
            module_spec = importlib.util.spec_from_file_location(f"qwenvl_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ValueError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module: a syntax error, a raise at import
        if isinstance(exc, SyntaxError):
            where = f"{exc.filename}, line {exc.lineno}"
        else:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{frame.filename}, line {frame.lineno}"
        raise ValueError(f"reward {spec!r}: {target} cannot be loaded: {type(exc).__name__}: {exc} "
                         f"({where})") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise ValueError(f"reward {spec!r}: {target} has no function {name}")
    return name, func


FLOAT32_MAX = 3.4028234663852886e38  # a larger reward overflows the float32 reward tensor to inf
SLOW_REWARD_S = 60.0  # a reward call slower than this is named once (no timeout: see docs/grpo.md)
_WARNED_SLOW: set[str] = set()


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


def _weight(text: str) -> float:
    """One of ``reward_weights``: a finite number (``nan`` trained on and logged ``reward: NaN``)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"reward_weights: {text.strip()!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"reward_weights: {text.strip()!r} is not a finite number")
    return value


def load_rewards(funcs: str, weights: str | None, cheat_rules: CheatRules = CheatRules()) -> list[Reward]:
    """The rewards of ``reward_funcs`` with their weights; ``no_cheat`` gets the run's ``no_cheat_*`` thresholds."""
    specs = [s for s in (funcs or "").split(",") if s.strip()]
    if not specs:
        raise ValueError("stage: grpo needs reward_funcs, e.g. `reward_funcs: iou,format`")
    values = [_weight(w) for w in weights.split(",")] if weights else [1.0] * len(specs)
    if len(values) != len(specs):
        raise ValueError(f"reward_weights has {len(values)} values for {len(specs)} reward_funcs")
    rewards = []
    for spec, weight in zip(specs, values):
        name, func = load_reward(spec)
        if func is no_cheat_reward:
            func = partial(no_cheat_reward, rules=cheat_rules)
        reward = Reward(name, func, weight, _keywords(func))
        if reward.legacy_policy:
            warnings.warn(f"reward {name!r} takes the keyword `policy`, renamed `resize_policy` (in GRPO code "
                          "'policy' means the model being trained); it still receives it for now", FutureWarning,
                          stacklevel=2)
        rewards.append(reward)
    return rewards


class RewardExit(RuntimeError):
    """A reward called ``sys.exit``: a failure of that reward, not the end of the run (it ended with rc 0 and no
    adapter)."""


def _call(reward: Reward, completions: list[str], columns: dict[str, list], shared: dict[str, Any]) -> list[float]:
    """The reward's values; it gets copies of the lists, so one that empties or reorders them cannot change what
    its values are checked against (or what the next reward sees)."""
    kwargs = {**{key: list(value) for key, value in columns.items()}, **shared,
              "policy": shared["resize_policy"]}  # ``policy``: the pre-rename keyword
    if reward.accepts is not None:
        kwargs = {key: value for key, value in kwargs.items() if key in reward.accepts}
    start = time.perf_counter()
    try:
        returned = reward.func(list(completions), **kwargs)
    except SystemExit as exc:
        raise RewardExit(f"the reward called sys.exit({exc.code!r})") from None
    values = [float(v) for v in returned]
    if len(values) != len(completions):
        raise ValueError(f"returned {len(values)} rewards for {len(completions)} completions")
    elapsed = time.perf_counter() - start
    if elapsed > SLOW_REWARD_S and reward.name not in _WARNED_SLOW:
        _WARNED_SLOW.add(reward.name)
        warnings.warn(f"reward {reward.name!r} took {elapsed:.0f} s for {len(completions)} completions: the "
                      "whole run waits for it at every rollout", RuntimeWarning, stacklevel=2)
    return values


def _traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(error, chain=False)).rstrip()


class Scored(NamedTuple):
    values: list[float]  # 0 where the reward failed
    errors: list[bool]  # which completions made it fail (raised, NaN or inf)
    failure: str | None  # the first failure, with its traceback and completion; None when it never failed


def score(reward: Reward, completions: list[str], columns: dict[str, list], shared: dict[str, Any]) -> Scored:
    """A reward's values for ``completions`` (``columns`` hold one entry per completion). A reward that raises on
    the batch is called again per completion, so only the completions that make it fail (or give NaN / inf) score
    0; the first failure is described so that the caller can show it."""
    batch_failure = first_failure = None
    try:
        values = _call(reward, completions, columns, shared)
    except Exception as error:  # noqa: BLE001 - a user reward is checked here, the caller decides what it costs
        batch_failure = f"on the batch of {len(completions)} completions:\n{_traceback(error)}"
        values = []
        for i, completion in enumerate(completions):
            try:
                values += _call(reward, [completion], {k: v[i:i + 1] for k, v in columns.items()}, shared)
            except Exception as error:  # noqa: BLE001
                values.append(math.nan)
                first_failure = first_failure or f"on the completion {completion!r}:\n{_traceback(error)}"
    errors = [not math.isfinite(v) or abs(v) > FLOAT32_MAX for v in values]
    failure = first_failure or batch_failure
    if failure is None and any(errors):
        bad = next(c for c, e in zip(completions, errors) if e)
        value = values[errors.index(True)]
        what = f"{value}" if not math.isfinite(value) else f"{value:g}, beyond float32's range (the rewards' dtype)"
        failure = f"returned {what} for the completion {bad!r}"
    return Scored([0.0 if bad else v for v, bad in zip(values, errors)], errors, failure)


def reward_inputs(meta: Sequence[Any], repeat: int, resize_policy: Any, coords: str,
                  lengths: Sequence[int] | None = None, max_completion_length: int | None = None,
                  overlong_buffer: int | None = None) -> tuple[dict[str, list], dict[str, Any]]:
    """The reward keywords for prompts ``meta`` (``SampleMeta``): per-completion columns (each prompt's values
    ``repeat`` times; ``completion_lengths`` in tokens) and the values shared by every completion."""
    columns = dict(
        references=[m.reference for m in meta for _ in range(repeat)],
        prompts=[m.prompt for m in meta for _ in range(repeat)],
        orig_sizes=[m.orig_hw for m in meta for _ in range(repeat)],
        model_sizes=[m.model_hw for m in meta for _ in range(repeat)],
        indices=[m.index for m in meta for _ in range(repeat)],
        metas=[m.meta for m in meta for _ in range(repeat)],
        completion_lengths=list(lengths) if lengths is not None else [None] * (len(meta) * repeat),
    )
    return columns, dict(resize_policy=resize_policy, coords=coords, max_completion_length=max_completion_length,
                         overlong_buffer=overlong_buffer)
