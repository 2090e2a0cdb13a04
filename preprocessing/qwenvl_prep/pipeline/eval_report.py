"""``qwenvl-prep eval --report``: 95% confidence intervals by bootstrap over records, the paired difference of two
predictions files, and a Markdown report that says what was evaluated.

Every interval is the percentile interval of the metric over ``resamples`` bootstrap samples of the records (drawn
with replacement, within each subset, seeded). Each record keeps its own tally (``evaluate``'s ``per_record``); a
resample sums the tallies' counters with the records' multiplicities and asks the same ``to_dict`` as the plain
evaluation, so an interval is of exactly the metric in the table. Metrics that need more than counters (COCO mAP,
medians) get none. A paired difference resamples the same records for both files: it is the interval that says
whether a gap between two models on one benchmark is more than the draw of the records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from llamafactory_qwenvl_patch.scoring.grounding_eval import GroundingEval
from llamafactory_qwenvl_patch.scoring.metrics import FieldTally
from qwenvl_prep.formats.prompt_presets import ANSWERS

CONFIDENCE = 0.95
METRICS = {  # a tally summary's section -> the rates that get an interval
    "boxes": ("acc@0.5", "mean_iou", "parse_failure_rate"),
    "clicks": ("click_acc", "click_dense_mean", "no_click_rate", "first_box_acc@0.5"),
    "spans": ("r1@0.3", "r1@0.5", "r1@0.7", "mean_tiou", "parse_failure_rate"),
    "tracks": ("acc@0.5", "mean_iou", "mean_track_score"),
    "fields": ("all_fields_exact", "format_valid_rate", "parse_failure_rate", "mean_fields_reward"),
    "agent": ("success_rate", "mean_steps_to_success", "invalid_action_rate", "env_failure_rate", "mean_return"),
}
VERSIONED = ("llamafactory-qwenvl-patch", "llamafactory", "transformers", "torch", "vllm", "qwen-vl-utils")

PerRecord = Sequence[tuple[str | None, Any]]
Path_ = tuple[Any, ...]


def _counters(obj: Any, prefix: Path_ = ()) -> dict[Path_, float]:
    """Every number a tally sums, by its path (fields of nested dataclasses, entries of dicts of numbers)."""
    out: dict[Path_, float] = {}
    for item in dataclasses.fields(obj):
        value = getattr(obj, item.name)
        path = prefix + (item.name,)
        if dataclasses.is_dataclass(value):
            out.update(_counters(value, path))
        elif isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
            out.update({path + ((key,),): float(v) for key, v in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[path] = float(value)
    return out


def _rebuilt(kind: type, names: list[Path_], totals: np.ndarray) -> Any:
    """A fresh tally of ``kind`` holding ``totals``."""
    obj = kind(detection_on=False) if kind is GroundingEval else kind()
    for path, total in zip(names, totals.tolist()):
        target = obj
        for step in path[:-1]:
            target = getattr(target, step)
        leaf = path[-1]
        if isinstance(leaf, tuple):
            target[leaf[0]] = total
        else:
            setattr(target, leaf, total)
    return obj


def _summary(tally: Any) -> dict[str, Any]:
    return {"fields": tally.to_dict()} if isinstance(tally, FieldTally) else tally.to_dict()


class Resampler:
    """The records' tallies as one counter matrix per tally kind, so a resample is a weighted sum."""

    def __init__(self, per_record: PerRecord) -> None:
        rows: dict[type, list[tuple[int, dict[Path_, float]]]] = {}
        for i, (_, tally) in enumerate(per_record):
            rows.setdefault(type(tally), []).append((i, _counters(tally)))
        self.kinds = []
        for kind, entries in rows.items():
            names = sorted({name for _, counters in entries for name in counters}, key=repr)
            matrix = np.array([[counters.get(name, 0.0) for name in names] for _, counters in entries])
            self.kinds.append((kind, np.array([i for i, _ in entries]), names, matrix))

    def metrics(self, weights: np.ndarray) -> dict[str, float]:
        """Each metric of ``METRICS`` over the records weighted by ``weights`` (multiplicities)."""
        out: dict[str, float] = {}
        for kind, index, names, matrix in self.kinds:
            w = weights[index]
            if not w.any():
                continue
            summary = _summary(_rebuilt(kind, names, w @ matrix))
            for section, keys in METRICS.items():
                for key in keys:
                    value = summary.get(section, {}).get(key)
                    if value is not None:
                        out[f"{section}/{key}"] = value
        return out


def _interval(values: list[float]) -> list[float]:
    tail = (1 - CONFIDENCE) / 2 * 100
    return [round(float(np.percentile(values, tail)), 4), round(float(np.percentile(values, 100 - tail)), 4)]


def intervals(per_record: PerRecord, resamples: int = 1000, seed: int = 0, other: PerRecord | None = None
              ) -> dict[str, Any]:
    """Per subset (``overall`` and each ``--by`` group): n, each metric's value and 95% interval, and with
    ``other`` (the second predictions file's records, aligned) each metric of both, their difference and its
    interval from the same resamples."""
    n = len(per_record)
    if other is not None and [s for s, _ in other] != [s for s, _ in per_record]:
        raise ValueError("the two predictions files were scored on different records")
    groups: dict[str, np.ndarray] = {"overall": np.arange(n)}
    for name in sorted({subset for subset, _ in per_record if subset is not None}):
        groups[name] = np.array([i for i, (subset, _) in enumerate(per_record) if subset == name])
    ours, theirs = Resampler(per_record), Resampler(other) if other is not None else None
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for name, index in groups.items():
        if not len(index):
            continue
        whole = np.zeros(n)
        whole[index] = 1
        point = ours.metrics(whole)
        base = theirs.metrics(whole) if theirs else {}
        draws: dict[str, list[float]] = {key: [] for key in point}
        gaps: dict[str, list[float]] = {key: [] for key in point if key in base}
        for _ in range(resamples):
            weights = np.bincount(rng.choice(index, size=len(index)), minlength=n).astype(float)
            mine = ours.metrics(weights)
            other_metrics = theirs.metrics(weights) if theirs else {}
            for key in draws:
                if key in mine:
                    draws[key].append(mine[key])
                if key in gaps and key in mine and key in other_metrics:
                    gaps[key].append(mine[key] - other_metrics[key])
        row: dict[str, Any] = {"n": int(len(index)), "metrics": {
            key: {"value": value, "ci95": _interval(draws[key]) if draws[key] else None} for key, value in point.items()}}
        if theirs:
            row["paired"] = {key: {"a": point[key], "b": base[key], "difference": round(point[key] - base[key], 4),
                                   "ci95": _interval(gaps[key]) if gaps[key] else None} for key in gaps}
        out[name] = row
    return {"resamples": resamples, "seed": seed, "confidence": CONFIDENCE, "subsets": out}


def settings_of(predictions: Path) -> dict[str, Any] | None:
    """What ``qwenvl-prep predict`` recorded beside its output (``<output>.settings.json``); None for others (LF's
    ``generated_predictions.jsonl``) and for a file that is not a JSON object."""
    path = predictions.with_name(predictions.name + ".settings.json")
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) else None


def versions() -> dict[str, str]:
    """The evaluating environment's versions of what the numbers depend on."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


_LINE_BREAKS = re.compile(r"\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")


def recorded(value: Any) -> str:
    """A recorded value (a path, a prompt, a settings entry: text anyone who can write the predictions folder
    chose) as an inline code span that no renderer reads as Markdown or HTML: text as it is, anything else as
    JSON, line breaks flattened to spaces (no value starts a heading or a table row), and fenced by one backtick more
    than its longest run of backticks, padded where it starts or ends with one (CommonMark's code span), so a
    backtick in a prompt cannot end the span and let the rest through as HTML."""
    text = value if isinstance(value, str) and value.strip() else json.dumps(value, sort_keys=True,
                                                                            ensure_ascii=False)
    text = _LINE_BREAKS.sub(" ", text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or (text[:1] == text[-1:] == " " and text.strip()) else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(subset: str) -> str:
    """A subset in a table cell: ``overall``, or one named after the records' ``--by`` values (recorded), where a
    pipe, even in a code span, would split the cell (GFM tables)."""
    return subset if subset == "overall" else recorded(subset).replace("|", "\\|")


def _preset_line(prompt: dict[str, Any]) -> str:
    """A prompt preset in one line: its name, family and source, its template, and its system prompt by length and
    digest (the whole text is in the settings file)."""
    line = (f"preset {recorded(prompt.get('preset'))} for {recorded(prompt.get('family'))} "
            f"({recorded(prompt.get('source'))}); template {recorded(prompt.get('template'))}")
    system = prompt.get("system")
    if isinstance(system, str):
        line += (f"; system prompt of {len(system)} characters (sha256 "
                 f"{hashlib.sha256(system.encode()).hexdigest()[:16]})")
    if prompt.get("prefill"):
        line += f"; answer prefilled with {recorded(prompt['prefill'])}"
    answer = prompt.get("answer")
    known = isinstance(answer, str) and answer in ANSWERS
    return line + f"; answers read as {ANSWERS[answer] if known else recorded(answer)}"


def report_markdown(result: dict[str, Any], stamp_policy: dict[str, Any] | None, predictions: Sequence[Path]) -> str:
    """The report: what was evaluated (dataset, its frame, each predictions file's model, prompt and settings, the
    versions), then per subset n, each metric with its interval, and the paired differences."""
    lines = ["# Evaluation report", "", f"- dataset: {recorded(result['dataset'])} ({result['records']} records)"]
    if stamp_policy:
        lines.append(f"- dataset frame (its stamp): {recorded(stamp_policy)}")
    for label, path in zip("AB", predictions):
        lines.append(f"- predictions {label}: {recorded(str(path))}")
        settings = settings_of(path)
        if settings is None:
            lines.append("  - model, prompt and settings: not recorded (not written by qwenvl-prep predict)")
            continue
        for key in ("model_dir", "policy", "prompt", "settings", "versions"):
            if isinstance(settings.get(key), dict) and "preset" in settings[key]:
                lines.append(f"  - prompt: {_preset_line(settings[key])}")
            elif key in settings:
                lines.append(f"  - {key.replace('_', ' ')}: {recorded(settings[key])}")
    lines.append(f"- evaluated with: {recorded(versions())}")
    return "\n".join(lines + interval_lines(result["intervals"])) + "\n"


def interval_lines(ci: dict[str, Any], unit: str = "records", tell_apart: str = "this benchmark") -> list[str]:
    """The report's interval part (shared by ``eval --report`` and ``agent-eval --report``): how the intervals were
    drawn, per subset n, each metric with its interval, and the paired differences. ``unit`` is what was resampled
    (records, trajectories)."""
    lines = ["", f"Intervals: {ci['confidence']:.0%} percentile bootstrap over {unit} ({ci['resamples']} resamples "
             f"within each subset, seed {ci['seed']}). An interval is how far the metric moves when the same "
             f"model is scored on another draw of {unit} of this kind; two models whose paired difference "
             f"interval holds 0 are not told apart by {tell_apart}.", "",
             "| subset | n | metric | value | 95% interval |", "|---|---|---|---|---|"]
    for name, row in ci["subsets"].items():
        for key, entry in row["metrics"].items():
            lines.append(f"| {_cell(name)} | {row['n']} | {key} | {entry['value']:.4f} | {_span(entry['ci95'])} |")
    if any("paired" in row for row in ci["subsets"].values()):
        lines += ["", f"Paired difference A - B (the same resampled {unit} for both):", "",
                  "| subset | metric | A | B | A - B | 95% interval |", "|---|---|---|---|---|---|"]
        for name, row in ci["subsets"].items():
            for key, entry in row.get("paired", {}).items():
                lines.append(f"| {_cell(name)} | {key} | {entry['a']:.4f} | {entry['b']:.4f} "
                             f"| {entry['difference']:+.4f} "
                             f"| {_span(entry['ci95'])} |")
    return lines


def _span(bounds: list[float] | None) -> str:
    return "-" if bounds is None else f"[{bounds[0]:.4f}, {bounds[1]:.4f}]"
