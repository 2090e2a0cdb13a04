"""What a rollout logs about its scored completions: the reward statistics and the hack monitors (detection, span
and click), each read in the frame the model answered in."""

from __future__ import annotations

import torch

from llamafactory_qwenvl_patch.frame.policy import frame_extent
from llamafactory_qwenvl_patch.grpo.algorithm.advantages import zero_std_groups
from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta
from llamafactory_qwenvl_patch.scoring.answers import try_parse_items
from llamafactory_qwenvl_patch.scoring.clicks import ClickMonitorTally
from llamafactory_qwenvl_patch.scoring.detection import MonitorTally, detections
from llamafactory_qwenvl_patch.scoring.temporal import SpanMonitorTally, meta_duration, reference_kind, try_parse_spans


def rollout_metrics(rewards: torch.Tensor, lengths: torch.Tensor, stopped: torch.Tensor, texts: list[str],
                    meta: list[SampleMeta], generations: int) -> dict[str, float]:
    """The logged statistics of one rollout's scored (non-blank) completions, G per prompt in ``meta``."""
    grounded = [bool(try_parse_items(sample.reference)) for sample in meta]  # once per prompt, not per completion
    stats = {
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "frac_reward_zero_std": float(zero_std_groups(rewards, generations).float().mean()),
        "completion_length/mean": float(lengths.mean()),
        "completion_length/max": float(lengths.max()),
        "truncated_ratio": float((~stopped).float().mean()),
        "parse_failures": float(sum(not try_parse_items(text) for i, text in enumerate(texts)
                                    if grounded[i // generations])),
    }
    return stats


def add_monitors(tally: MonitorTally, spans: SpanMonitorTally, texts: list[str], meta: list[SampleMeta],
                 generations: int, coords: str, clicks: ClickMonitorTally | None = None) -> None:
    """Count the detection-hack monitors of completions whose prompts have reference boxes, in the model frame (a
    box track is not a many-box answer: it is left out), the span monitors of those with reference spans and, given
    ``clicks`` (a run rewarded for clicks), the click monitors of every group whose prompt has an image."""
    if clicks is not None:
        for start in range(0, len(texts), generations):
            sample = meta[start // generations]
            if sample.orig_hw is not None and sample.model_hw is not None and reference_kind(sample.reference) is None:
                clicks.add_group(texts[start:start + generations],
                                 frame_extent(coords, sample.orig_hw, sample.model_hw))
    for i, text in enumerate(texts):
        sample = meta[i // generations]
        kind = reference_kind(sample.reference)
        if kind == "span":
            spans.add(try_parse_spans(sample.reference) or [], try_parse_spans(text), meta_duration(sample.meta))
            continue
        truth = detections(sample.reference) if kind is None else None
        if truth and sample.orig_hw is not None and sample.model_hw is not None:
            tally.add(truth, detections(text), frame_extent(coords, sample.orig_hw, sample.model_hw))
