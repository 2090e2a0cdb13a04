"""The environment API's types: what an environment returns (``Observation``, ``Step``), what it is sent
(``Action``) and the protocol its class follows (``Environment``). Public and stable: user environments import them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from PIL import Image

from llamafactory_qwenvl_patch.scoring.actions import ACTION_KINDS as MODEL_KINDS

INVALID = "invalid"
ACTION_KINDS = (*MODEL_KINDS, INVALID)  # click, type, scroll, key, done, invalid


@dataclass(frozen=True)
class Observation:
    """What the model is shown on a turn: a screenshot (any size the run's frame policy accepts; it is resized to
    the pinned frame before the model sees it) and optional text shown after it."""

    image: Image.Image
    text: str = ""


@dataclass(frozen=True)
class Step:
    """What ``step`` returns: the next observation, this action's reward, whether the episode ended, and free-form
    ``info`` (``info["state_key"]``, if given, names the screen state the action led to: step-level credit groups
    steps by it, so it must be hashable)."""

    observation: Observation
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Action:
    """One turn's action as the environment receives it. ``x``, ``y`` are pixels of the screenshot shown on that
    turn (floats; None for kinds without a point), already mapped from the model's frame. ``raw`` is the model's
    text; ``reason`` says why an ``invalid`` action could not be read (unparsable, out of frame, non-finite): the
    environment decides what an invalid action does (usually nothing)."""

    kind: str
    x: float | None = None
    y: float | None = None
    text: str | None = None
    direction: str | None = None
    key: str | None = None
    raw: str = ""
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"action kind {self.kind!r} is not one of {', '.join(ACTION_KINDS)}")


@runtime_checkable
class Environment(Protocol):
    """The protocol an environment class follows (duck-typed: no base class needed). One instance per trajectory,
    made with the run's keyword arguments; ``reset`` shows the first screenshot of ``task`` (the record's ``meta``)
    for ``seed`` and must give the same observation for the same (task, seed): the G trajectories of a group start
    from one screen. ``close`` runs at every end of a trajectory, except after a timeout (the instance is then never
    called again)."""

    def reset(self, task: dict, seed: int) -> Observation: ...

    def step(self, action: Action) -> Step: ...

    def close(self) -> None: ...


PROTOCOL_METHODS = ("reset", "step", "close")
