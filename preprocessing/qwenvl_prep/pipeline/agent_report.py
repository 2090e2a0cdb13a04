"""``qwenvl-prep agent-eval --report``: success rate, steps to success and invalid-action rate of an agent's
trajectories, with the bootstrap intervals and paired comparison of ``eval --report`` (``eval_report.intervals``).

Each trajectory (one row of ``agent-eval -o``) becomes an ``AgentTally`` of counters, and the rates are ratios of
summed counters, so ``eval_report``'s resampler draws trajectories as it draws records: an interval is of exactly the
number in the table. A trajectory that the environment ended (``env_error``, ``env_timeout``) says nothing about the
model: it counts in ``env_failure_rate`` and in no other rate. A paired comparison takes a second output of the same
tasks (the same task and seed each), aligned by task, so both are scored on the same resampled tasks.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from qwenvl_prep.pipeline.eval_report import interval_lines, intervals, recorded, settings_of, versions

ENV_FAILURES = ("env_error", "env_timeout")
REPORTED = ("model_dir", "policy", "env", "tasks", "prompt", "settings", "versions")


@dataclass
class AgentTally:
    """One trajectory's counters (or many summed): the report's rates are ratios of these."""

    trajectories: float = 0.0
    env_failures: float = 0.0
    successes: float = 0.0
    success_steps: float = 0.0  # the actions of the successful trajectories
    actions: float = 0.0
    invalid_actions: float = 0.0
    returns: float = 0.0  # the summed rewards of the trajectories the environment completed

    def to_dict(self) -> dict[str, Any]:
        def ratio(a: float, b: float) -> float | None:
            return round(a / b, 4) if b else None

        completed = self.trajectories - self.env_failures
        return {"agent": {"success_rate": ratio(self.successes, completed),
                          "mean_steps_to_success": ratio(self.success_steps, self.successes),
                          "invalid_action_rate": ratio(self.invalid_actions, self.actions),
                          "env_failure_rate": ratio(self.env_failures, self.trajectories),
                          "mean_return": ratio(self.returns, completed)}}


def tally(row: dict[str, Any]) -> AgentTally:
    """A trajectory row's tally; ValueError naming what a row that ``agent-eval`` did not write lacks."""
    if not isinstance(row, dict):
        raise ValueError(f"not a row of qwenvl-prep agent-eval: a JSON {type(row).__name__}, not an object")
    try:
        turns, end = row["turns"], row["end"]
        if not isinstance(end, str):
            raise TypeError(f"'end' ({type(end).__name__}, not a string)")
        failed = end in ENV_FAILURES
        actions = len(turns)
        invalid = sum(turn["action"]["kind"] == "invalid" for turn in turns)
        success = bool(row["success"])
        returned = float(row["return"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a row of qwenvl-prep agent-eval (task {row.get('task')!r} if a dict): missing or "
                         f"malformed {exc}") from None
    return AgentTally(1.0, float(failed), float(success), float(actions) if success else 0.0, float(actions),
                      float(invalid), 0.0 if failed else returned)


def task_key(row: dict[str, Any]) -> str:
    """What pairs two outputs' trajectories: the task and its seed."""
    return json.dumps([row.get("task"), row.get("seed")], sort_keys=True)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a finished ``agent-eval`` output."""
    try:
        return [json.loads(line) for line in path.read_bytes().split(b"\n") if line.strip()]
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON lines: {exc}") from None


def paired_rows(rows: list[dict[str, Any]], other: list[dict[str, Any]], other_path: Path) -> list[dict[str, Any]]:
    """``other``'s rows in the order of ``rows``' tasks; ValueError when the two did not run the same tasks."""
    mine = [task_key(row) for row in rows]
    found = {task_key(row): row for row in other}
    if len(found) != len(other) or sorted(found) != sorted(mine) or len(set(mine)) != len(mine):
        missing = len(set(mine) - set(found)), len(set(found) - set(mine))
        raise ValueError(f"--compare {other_path} did not run the same tasks (task and seed): {missing[0]} of these "
                         f"are not in it, {missing[1]} of its are not here; compare outputs of the same --tasks or "
                         "--dataset")
    return [found[key] for key in mine]


def agent_result(rows: list[dict[str, Any]], resamples: int = 1000, seed: int = 0,
                 other: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The metrics, the end statuses and the intervals (with ``other``, aligned: the paired differences)."""
    per_record = [(None, tally(row)) for row in rows]
    whole = AgentTally()
    for _, one in per_record:
        for name, value in vars(one).items():
            setattr(whole, name, getattr(whole, name) + value)
    theirs = [(None, tally(row)) for row in other] if other is not None else None
    return {"trajectories": len(rows), "ends": dict(Counter(row["end"] for row in rows)), **whole.to_dict(),
            "intervals": intervals(per_record, resamples, seed, theirs)}


def compare_problem(settings: dict[str, Any] | None, other: dict[str, Any] | None) -> str | None:
    """Why two outputs' success cannot be compared (another success reward), or None."""
    ours = (settings or {}).get("settings", {}).get("success_reward")
    theirs = (other or {}).get("settings", {}).get("success_reward") if isinstance(other, dict) else None
    if ours is not None and theirs is not None and ours != theirs:
        return f"it counts a success from a return of {theirs}, this run from {ours}"
    return None


def agent_report_markdown(result: dict[str, Any], outputs: Sequence[Path]) -> str:
    """The report: what ran (each output's model, frame, environment, tasks, prompt, settings and versions, as
    recorded beside it), how trajectories ended, then each metric with its interval and the paired differences."""
    lines = ["# Agent evaluation report", "", f"- trajectories: {result['trajectories']}; ends: "
             + ", ".join(f"{recorded(end)} {n}" for end, n in sorted(result["ends"].items()))]
    for label, path in zip("AB", outputs):
        lines.append(f"- trajectories {label}: {recorded(str(path))}")
        settings = settings_of(path) or {}
        for key in REPORTED:
            if key in settings:
                lines.append(f"  - {key.replace('_', ' ')}: {recorded(settings[key])}")
    lines.append(f"- evaluated with: {recorded(versions())}")
    lines += ["", "success_rate and mean_return are over the trajectories the environment completed (not ended "
              "env_error or env_timeout); mean_steps_to_success is the actions of the successful ones; "
              "invalid_action_rate is over every action sent."]
    return "\n".join(lines + interval_lines(result["intervals"], "tasks", "these tasks")) + "\n"
