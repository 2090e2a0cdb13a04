"""GRPO evaluation metrics from greedy answers: each reward's mean and, for grounding data, Acc@0.5, mean IoU, parse
failures, click accuracy, detection precision / recall / F1 / mAP, the hack monitors in original-image pixels and
the answers to "not present" records (the metrics of ``qwenvl-prep eval``); field-extraction metrics for JSON
answers; for video records R@1 at tIoU and mean tIoU of spans and the per-frame scores of box tracks. Pure: the trainer collects the answers, this scores them."""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.grpo.rewards.registry import Reward, reward_inputs, score
from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta
from llamafactory_qwenvl_patch.scoring.answers import try_parse_items
from llamafactory_qwenvl_patch.scoring.fields import reference_value, score_fields
from llamafactory_qwenvl_patch.scoring.grounding_eval import GroundingEval, is_grounding
from llamafactory_qwenvl_patch.scoring.metrics import IOU_THRESHOLD, FieldTally
from llamafactory_qwenvl_patch.scoring.video_eval import VideoEval

VIDEO_PAD = "<|video_pad|>"  # a video prompt's text as the rewards read it (image pads are collapsed, video ones not)


def eval_metrics(meta: Sequence[SampleMeta], texts: Sequence[str], rewards: Sequence[Reward],
                 resize_policy: ResizePolicy | None, coords: str, prefix: str,
                 lengths: tuple[Sequence[int], int, int | None] | None = None) -> dict[str, float]:
    """``{prefix}_reward``, ``{prefix}_rewards/<name>/mean``, the grounding metrics and the field metrics of one
    greedy answer per prompt. ``lengths``: (each answer's tokens, max_new_tokens, the overlong buffer)."""
    columns, shared = reward_inputs(meta, 1, resize_policy, coords, *(lengths or ()))
    metrics: dict[str, Any] = {f"{prefix}_samples": float(len(texts))}
    total = torch.zeros(len(texts))
    for reward in rewards:
        values = score(reward, list(texts), columns, shared).values
        metrics[f"{prefix}_rewards/{reward.name}/mean"] = sum(values) / max(len(values), 1)
        total += reward.weight * torch.tensor(values)
    metrics[f"{prefix}_reward"] = float(total.mean()) if len(texts) else 0.0
    grounding, fields, video = GroundingEval(), FieldTally(), VideoEval()
    for sample, text in zip(meta, texts):
        # spans and box tracks first: a track's boxes are not an image's, nor a span a field (as qwenvl-prep eval);
        # boxes compared in the model's frame, where IoU equals the clip's pixels' up to clamping
        if video.add(sample.reference, text, sample.meta, has_video=VIDEO_PAD in sample.prompt):
            continue
        items = try_parse_items(sample.reference) or []
        grounded = is_grounding(items, sample.reference, sample.meta)
        truth = reference_value(sample.reference) if not grounded else None
        if truth is not None:
            fields.add(score_fields(text, truth))
        if not grounded or sample.orig_hw is None or sample.model_hw is None:
            continue
        to_orig = partial(convert_coords, src=coords, dst="orig", orig_hw=sample.orig_hw,
                          model_hw=sample.model_hw, ndigits=None)
        grounding.add(items, text, sample.meta, to_orig, (sample.orig_hw[1], sample.orig_hw[0]))
    metrics.update(_grounding_metrics(grounding.to_dict(), prefix))
    for section, values in video.to_dict().items():
        metrics.update({f"{prefix}_{section}/{key}": value for key, value in values.items()
                        if isinstance(value, (int, float)) and key != "samples"})
    if fields.samples:
        summary = fields.to_dict()
        for key in ("all_fields_exact", "format_valid_rate", "parse_failure_rate", "mean_fields_reward"):
            metrics[f"{prefix}_fields/{key}"] = summary[key]
        for path, accuracy in summary["per_field_accuracy"].items():
            metrics[f"{prefix}_fields/acc/{path}"] = accuracy
    return {key: round(float(value), 6) for key, value in metrics.items()}


def _grounding_metrics(summary: dict[str, Any], prefix: str) -> dict[str, float]:
    """The eval log keys of ``GroundingEval``'s summary (those ``qwenvl-prep eval`` reports)."""
    metrics: dict[str, float] = {}
    if "boxes" in summary:
        boxes = summary["boxes"]
        metrics[f"{prefix}_acc@{IOU_THRESHOLD}"] = boxes[f"acc@{IOU_THRESHOLD}"] or 0.0
        metrics[f"{prefix}_mean_iou"] = boxes["mean_iou"] or 0.0
        metrics[f"{prefix}_parse_failure_rate"] = boxes["parse_failure_rate"]
    if "not_present" in summary:
        for key in ("said_nothing_rate", "false_positive_rate"):
            metrics[f"{prefix}_not_present/{key}"] = summary["not_present"][key]
    if "clicks" in summary:
        metrics[f"{prefix}_click_acc"] = summary["clicks"]["click_acc"]
        metrics[f"{prefix}_click_dense_mean"] = summary["clicks"]["click_dense_mean"]
    for section, keys in (("detection", ("precision@0.5", "recall@0.5", "f1@0.5", "map")),
                          ("monitors", ("whole_image_rate", "empty_answer_rate", "duplicate_rate",
                                        "area_ratio_median", "count_ratio"))):
        for key in keys:
            value = summary.get(section, {}).get(key)
            if value is not None:
                metrics[f"{prefix}_{'det' if section == 'detection' else 'monitor'}/{key}"] = value
    return metrics
