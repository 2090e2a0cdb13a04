"""The built-in rewards of multi-turn agent runs (``grpo_agent_env``). Every reward of such a run receives, beside
the usual keywords (the completion there is the trajectory's actions joined by newlines), ``trajectories``: one dict
per completion, ``{"turns": [{"text", "action", "reward", "info", "orig_hw", "model_hw"}, ...], "end": status}``,
``action`` being what the environment was sent (kind, x and y in that turn's screenshot pixels, ...)."""

from __future__ import annotations

from typing import Any, Sequence

INVALID = "invalid"


def _trajectories(trajectories: Sequence[dict] | None, name: str) -> Sequence[dict]:
    if trajectories is None:
        raise ValueError(f"reward {name!r} scores environment trajectories: the run needs grpo_agent_env")
    return trajectories


def env_reward(completions: Sequence[str], *, trajectories: Sequence[dict] | None = None, **_: Any) -> list[float]:
    """The environment's rewards over the trajectory, summed (a failed trajectory gets no loss whatever it scores)."""
    return [float(sum(turn["reward"] for turn in t["turns"])) for t in _trajectories(trajectories, "env")]


def action_format_reward(completions: Sequence[str], *, trajectories: Sequence[dict] | None = None,
                         **_: Any) -> list[float]:
    """The share of the trajectory's actions the parser read (not ``invalid``): unparsable, out-of-frame and cut
    actions count against it. 0 for a trajectory without an action."""
    out = []
    for t in _trajectories(trajectories, "action_format"):
        turns = t["turns"]
        out.append(sum(turn["action"]["kind"] != INVALID for turn in turns) / len(turns) if turns else 0.0)
    return out


AGENT_REWARDS = {"env": env_reward, "action_format": action_format_reward}
