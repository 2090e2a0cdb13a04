"""Per-step credit for multi-turn agents, GiGPO's step-level groups (Feng et al., 2025, "Group-in-Group Policy
Optimization for LLM Agent Training"; verl-agent's ``core_gigpo.py``, ROLL's GiGPO): the G trajectories of a task
often pass through the same environment state; the steps taken from one state form an anchor group, and each step's
discounted return from there on is compared with its group's. A step gets

    A_step = (R_t - mean of its anchor group's R) / (the group's std, with grpo_scale_rewards: group)

where R_t = r_t + gamma r_{t+1} + ... over the rest of its trajectory, and each of its action tokens gets the
trajectory's advantage + ``grpo_agent_step_weight`` x A_step. The state a step was taken from is the environment's
``info["state_key"]`` of the step before (the task's start for the first step: the G members share it). A step with
no key, alone in its group, or of a trajectory that gets no loss has A_step 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Hashable, Sequence

START = ("start",)  # the state every member of a group acts from first
NO_KEY = object()  # a step after one whose info had no state_key: its own group


def anchor_keys(turns: Sequence[dict[str, Any]]) -> list[Hashable]:
    """The state each turn's action was taken from: the start, then the previous step's ``info["state_key"]``
    (JSON values made hashable; a missing key makes the step ungrouped)."""
    keys: list[Hashable] = [START]
    for turn in turns[:-1]:
        info = turn.get("info") or {}
        keys.append(_hashable(info["state_key"]) if "state_key" in info else NO_KEY)
    return keys[:len(turns)]


def _hashable(value: Any) -> Hashable:
    if isinstance(value, dict):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_t = r_t + gamma R_{t+1}, from the last step back."""
    out, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def step_advantages(trajectories: Sequence[Sequence[dict[str, Any]]], usable: Sequence[bool], G: int, gamma: float,
                    scale: bool) -> list[list[float]]:
    """Per trajectory (task-major, G a task), per step: its anchor-group advantage (the module's formula).
    ``trajectories`` are each trajectory's turn records (``reward``, ``info``); ``usable`` says which get a loss."""
    if len(trajectories) % G:
        raise ValueError(f"{len(trajectories)} trajectories are not whole groups of {G}")
    out = [[0.0] * len(turns) for turns in trajectories]
    for start in range(0, len(trajectories), G):
        groups: dict[Hashable, list[tuple[int, int, float]]] = defaultdict(list)
        for i in range(start, start + G):
            if not usable[i]:
                continue
            turns = trajectories[i]
            returns = discounted_returns([float(turn.get("reward") or 0.0) for turn in turns], gamma)
            for t, (key, value) in enumerate(zip(anchor_keys(turns), returns)):
                if key is not NO_KEY:
                    groups[key].append((i, t, value))
        for members in groups.values():
            if len(members) < 2:
                continue
            values = [value for _, _, value in members]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if scale else 1.0
            for i, t, value in members:
                out[i][t] = (value - mean) / (std + 1e-4) if scale else value - mean
    return out


def grouped_share(trajectories: Sequence[Sequence[dict[str, Any]]], usable: Sequence[bool], G: int) -> float:
    """The share of usable steps that share their anchor state with another step of their task's group (the
    steps GiGPO gives a step-level signal to)."""
    total = grouped = 0
    for start in range(0, len(trajectories), G):
        counts: dict[Hashable, int] = defaultdict(int)
        keys = []
        for i in range(start, start + G):
            if usable[i]:
                keys.append(anchor_keys(trajectories[i]))
                for key in keys[-1]:
                    counts[key] += key is not NO_KEY
        for row in keys:
            total += len(row)
            grouped += sum(key is not NO_KEY and counts[key] > 1 for key in row)
    return grouped / total if total else 0.0
