"""The reward API, the loader for ``reward_funcs`` (built-ins in ``rewards.builtin``) and the harness that scores.

The reward API: ``fn(completions, *, references, prompts, orig_sizes, model_sizes, resize_policy, indices, metas,
coords, completion_lengths, max_completion_length, overlong_buffer) -> list[float]``, one entry per completion;
``reward_inputs`` builds the keywords and docs/grpo.md ("Your own reward") says what each holds. A custom reward
that raises or returns NaN scores 0 for the completions concerned (found by scoring the batch again one completion at
a time), and each is counted.
"""

from __future__ import annotations

import inspect
import math
import time
import traceback
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Sequence

from llamafactory_qwenvl_patch.agent.loading import import_target
from llamafactory_qwenvl_patch.grpo.rewards.builtin import BUILTIN, RewardFunc, no_cheat_reward
from llamafactory_qwenvl_patch.scoring.cheats import CheatRules


def load_reward(spec: str) -> tuple[str, RewardFunc]:
    """A built-in name, ``package.module:function`` or ``path/to/file.py:function``."""
    spec = spec.strip()
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: not a built-in ({', '.join(BUILTIN)}) and not module:function")
    target, name = spec.rsplit(":", 1)
    module = import_target(target, f"reward {spec!r}", "qwenvl_reward_")
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


def pick_scored(parts: list[list[Scored]], rows: list[tuple[int, int]]) -> list[Scored]:
    """Each reward's ``Scored`` over the completions ``rows`` ((source, completion) pairs, in order) of several
    scored sources; a failure description is kept where one of the picked completions failed."""
    picked = []
    for reward in range(len(parts[0]) if parts else 0):
        values = [parts[source][reward].values[i] for source, i in rows]
        errors = [parts[source][reward].errors[i] for source, i in rows]
        failures = [parts[source][reward].failure for source, i in rows if parts[source][reward].errors[i]]
        picked.append(Scored(values, errors, failures[0] if failures else None))
    return picked
