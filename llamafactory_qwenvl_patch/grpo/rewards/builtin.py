"""The built-in rewards (pure functions; the video ones in ``rewards.video``, DAPO's overlong one in
``rewards.length``) and ``BUILTIN``, the names ``reward_funcs`` takes. Built-ins never raise on garbage."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

from llamafactory_qwenvl_patch.frame.policy import PolicyError, frame_extent, map_coords
from llamafactory_qwenvl_patch.grpo.rewards.agent import AGENT_REWARDS
from llamafactory_qwenvl_patch.grpo.rewards.length import overlong_reward
from llamafactory_qwenvl_patch.grpo.rewards.video import VIDEO_REWARDS, video_format_ok
from llamafactory_qwenvl_patch.scoring.answers import not_present, try_parse_items
from llamafactory_qwenvl_patch.scoring.cheats import CheatRules, cheats
from llamafactory_qwenvl_patch.scoring.clicks import click_dense_score, click_hit, click_point, truth_box
from llamafactory_qwenvl_patch.scoring.detection import detection_f1, detections, sanity_penalty
from llamafactory_qwenvl_patch.scoring.fields import (
    FieldScore,
    confident,
    find_json,
    normalize,
    reference_value,
    score_fields,
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
    **AGENT_REWARDS,
}
