"""DAPO's soft overlong punishment as a built-in reward (Yu et al. 2025, eq. 13): a completion that stays out of the
last ``buffer`` tokens of ``max_new_tokens`` scores 0; inside that zone the penalty grows linearly to -1 at the
limit (a completion cut at the limit scores -1). Lengths are in tokens, as sampled."""

from __future__ import annotations

from typing import Any, Sequence


def default_buffer(max_completion_length: int) -> int:
    """A fifth of the limit (DAPO's 4,096 of 20,480), at least one token."""
    return max(1, max_completion_length // 5)


def overlong_penalty(length: int, max_completion_length: int, buffer: int) -> float:
    """0 up to ``max - buffer`` tokens, then ((max - buffer) - length) / buffer, down to -1 at ``max``."""
    free = max_completion_length - buffer
    if length <= free:
        return 0.0
    return max(-1.0, (free - length) / buffer)


def overlong_reward(completions: Sequence[str], *, completion_lengths: Sequence[int | None] | None = None,
                    max_completion_length: int | None = None, overlong_buffer: int | None = None,
                    **_: Any) -> list[float]:
    """Each completion's ``overlong_penalty``; 0 where its length is unknown (a caller that passes none)."""
    lengths = completion_lengths or [None] * len(completions)
    if not max_completion_length:
        return [0.0] * len(completions)
    buffer = min(overlong_buffer or default_buffer(max_completion_length), max_completion_length)
    return [0.0 if n is None else overlong_penalty(int(n), max_completion_length, buffer) for n in lengths]
