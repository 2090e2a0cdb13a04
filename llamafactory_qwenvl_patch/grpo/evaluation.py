"""GRPO evaluation metrics from greedy answers: each reward's mean and, for grounding data, Acc@0.5, mean IoU and
parse failures in original-image pixels and, for "not present" samples (reference ``[]``), how often the answer
was ``[]`` and how often it had boxes (the metrics of ``qwenvl-prep eval``); field-extraction metrics for JSON
answers. Pure: the trainer collects the answers, this scores them."""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.grpo.rewards import Reward, reward_inputs, score
from llamafactory_qwenvl_patch.grpo.rollout import SampleMeta
from llamafactory_qwenvl_patch.scoring.answers import parse_items, says_nothing, try_parse_items
from llamafactory_qwenvl_patch.scoring.fields import reference_value, score_fields
from llamafactory_qwenvl_patch.scoring.metrics import IOU_THRESHOLD, AbsentTally, FieldTally, Tally, score_grounding


def eval_metrics(meta: Sequence[SampleMeta], texts: Sequence[str], rewards: Sequence[Reward],
                 resize_policy: ResizePolicy | None, coords: str, prefix: str) -> dict[str, float]:
    """``{prefix}_reward``, ``{prefix}_rewards/<name>/mean``, the grounding metrics and the field metrics of one
    greedy answer per prompt."""
    columns, shared = reward_inputs(meta, 1, resize_policy, coords)
    metrics: dict[str, Any] = {f"{prefix}_samples": float(len(texts))}
    total = torch.zeros(len(texts))
    for reward in rewards:
        values = score(reward, list(texts), columns, shared).values
        metrics[f"{prefix}_rewards/{reward.name}/mean"] = sum(values) / max(len(values), 1)
        total += reward.weight * torch.tensor(values)
    metrics[f"{prefix}_reward"] = float(total.mean()) if len(texts) else 0.0
    tally, fields, absent = Tally(), FieldTally(), AbsentTally()
    for sample, text in zip(meta, texts):
        if says_nothing(sample.reference):
            absent.add(text)
            continue
        truth = reference_value(sample.reference) if not try_parse_items(sample.reference) else None
        if truth is not None:
            fields.add(score_fields(text, truth))
        if sample.orig_hw is None or sample.model_hw is None or not try_parse_items(sample.reference):
            continue
        to_orig = partial(convert_coords, src=coords, dst="orig", orig_hw=sample.orig_hw,
                          model_hw=sample.model_hw, ndigits=None)
        truth = [to_orig(item.coords) for item in parse_items(sample.reference) if item.kind == "bbox_2d"]
        tally.add(score_grounding(truth, text, to_orig))
    if tally.truth_boxes:
        summary = tally.to_dict()
        metrics[f"{prefix}_acc@{IOU_THRESHOLD}"] = summary[f"acc@{IOU_THRESHOLD}"] or 0.0
        metrics[f"{prefix}_mean_iou"] = summary["mean_iou"] or 0.0
        metrics[f"{prefix}_parse_failure_rate"] = summary["parse_failure_rate"]
    if absent.samples:
        summary = absent.to_dict()
        for key in ("said_nothing_rate", "false_positive_rate"):
            metrics[f"{prefix}_not_present/{key}"] = summary[key]
    if fields.samples:
        summary = fields.to_dict()
        for key in ("all_fields_exact", "format_valid_rate", "parse_failure_rate", "mean_fields_reward"):
            metrics[f"{prefix}_fields/{key}"] = summary[key]
        for path, accuracy in summary["per_field_accuracy"].items():
            metrics[f"{prefix}_fields/acc/{path}"] = accuracy
    return {key: round(float(value), 6) for key, value in metrics.items()}
