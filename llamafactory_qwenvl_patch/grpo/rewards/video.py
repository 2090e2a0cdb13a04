"""The video rewards (pure functions, registered with the others in ``builtin.BUILTIN``): ``tiou`` for temporal
spans, ``track`` for box tracks, ``span_sanity`` for the hacks of temporal grounding, and what ``format`` asks of a
video answer. The scores and hack rules are ``scoring.temporal``'s, shared with ``qwenvl-prep eval``.

A reference of another kind (an image box, a field, text) scores 0 under ``tiou`` and ``track`` and is left
untouched by ``span_sanity``, so a mixed dataset can list them all; ``[]`` (nothing there) is answered only by
``[]`` under ``track``, as under ``iou``.
"""

from __future__ import annotations

from typing import Any, Sequence

from llamafactory_qwenvl_patch.scoring.answers import not_present, try_parse_items
from llamafactory_qwenvl_patch.scoring.temporal import (
    SPAN_HACKS,
    meta_duration,
    parse_spans,
    parse_track,
    reference_kind,
    score_track,
    span_hacks,
    span_score,
    try_parse_spans,
    try_parse_track,
)

VIDEO_PAD = "<|video_pad|>"  # in a video prompt's text as the rewards get it


def tiou_reward(completions: Sequence[str], *, references: Sequence[str], **_: Any) -> list[float]:
    """Temporal IoU in [0, 1] against a span reference: spans matched one-to-one, summed tIoU over
    max(#truth, #predicted), so extra spans divide the credit. An empty or inverted span scores 0, a malformed
    answer 0."""
    out = []
    for completion, reference in zip(completions, references):
        is_span = reference_kind(reference) == "span"
        out.append(span_score(parse_spans(reference), try_parse_spans(completion) or []) if is_span else 0.0)
    return out


def track_reward(completions: Sequence[str], *, references: Sequence[str], prompts: Sequence[str] | None = None,
                 **_: Any) -> list[float]:
    """The spatio-temporal track score in [0, 1] against a track reference (``temporal.score_track``): each truth
    time takes the box at the nearest predicted time within half the truth's spacing (at most 0.5 s); summed IoU
    over the truth times plus the extra predicted boxes (repeated times, times outside the truth's range). Against
    an empty track ``[]`` (the target is not in the video), 1 for an answer ``[]`` and 0 for anything else, as
    ``iou``; only on video prompts (``prompts`` holding ``<|video_pad|>``), so that an image's abstention is not
    paid twice beside ``iou``."""
    prompts = prompts or [VIDEO_PAD] * len(completions)
    out = []
    for completion, reference, prompt in zip(completions, references, prompts):
        if not_present(reference):  # an empty track is a video's; an image's "not present" is iou's to pay
            out.append(1.0 if VIDEO_PAD in prompt and not_present(completion) else 0.0)
        elif reference_kind(reference) != "track":
            out.append(0.0)
        else:
            out.append(score_track(parse_track(reference), try_parse_track(completion) or []).score)
    return out


def span_sanity_reward(completions: Sequence[str], *, references: Sequence[str],
                       metas: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """-1/4 for each temporal hack the answer shows (``temporal.span_hacks``: the whole clip as the span when the
    truth is not that long and ``meta.duration`` is known, an empty or inverted span, a span outside the clip, more
    spans than the truth), in [-1, 0]. Never positive: honest answers are untouched."""
    metas = metas or [None] * len(completions)
    out = []
    for completion, reference, meta in zip(completions, references, metas):
        if reference_kind(reference) != "span":
            out.append(0.0)
        else:
            found = span_hacks(parse_spans(reference), try_parse_spans(completion) or [], meta_duration(meta))
            out.append(-len(found) / len(SPAN_HACKS))
    return out


def video_format_ok(completion: str, kind: str) -> bool:
    """The answer parses into a video reference's structure: at least one well-formed span (``{"span": [start,
    end]}``) for a span reference; for a track, at least one timed box and no other coordinate anywhere in the
    answer (every box and point the image parser finds is one of the track's)."""
    if kind == "span":
        return bool(try_parse_spans(completion))
    track, items = try_parse_track(completion), try_parse_items(completion)
    return bool(track) and items is not None and len(items) == len(track)


VIDEO_REWARDS = {"tiou": tiou_reward, "track": track_reward, "span_sanity": span_sanity_reward}
