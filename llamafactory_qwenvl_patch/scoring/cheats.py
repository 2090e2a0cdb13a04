"""Reward hacks of field-extraction (and other JSON) answers, detected without a model (pure functions).

Each detector compares the answer with the reference so that an honest answer, which looks like the reference, is
never flagged: length is measured against the reference's, repetition above the reference's own, and copying only
counts text that is in the prompt but not in the reference.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llamafactory_qwenvl_patch.scoring.fields import find_json, is_empty, reference_value

_TOKEN = re.compile(r"\w+|[^\w\s]")
REPETITION_MARGIN = 0.2  # an answer may repeat itself this much more than the reference does


@dataclass(frozen=True)
class CheatRules:
    """Thresholds (YAML keys ``no_cheat_*``)."""

    min_length_ratio: float = 0.25  # shorter than this share of the reference's compact length
    max_repetition: float = 0.5  # share of repeated n-grams
    max_copy: float = 0.5  # share of the answer's new n-grams (not in the reference) that come from the prompt
    ngram: int = 3


def tokens(text: str) -> list[str]:
    """Words and single punctuation marks, case-folded: whitespace and layout (pretty-printed JSON) do not count."""
    return _TOKEN.findall(text.casefold())


def ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def repetition(words: list[str], n: int) -> float:
    """Share of n-grams that repeat an earlier one (0 for text too short to have 2n tokens)."""
    grams = ngrams(words, n)
    if len(words) < 2 * n:
        return 0.0
    return 1 - len(set(grams)) / len(grams)


def _body(text: str) -> str:
    """The JSON inside a code fence when that is the whole answer (the fence is layout, not content)."""
    found = find_json(text)
    if found is not None and found[1]:
        return json.dumps(found[0], ensure_ascii=False)
    return text


def _compact(reference: str) -> str:
    value = reference_value(reference)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")) if value is not None else reference.strip()


def cheats(answer: str, reference: str, prompt: str = "", rules: CheatRules = CheatRules()) -> list[str]:
    """Names of the hacks ``answer`` shows: ``too_short`` (an answer not in the reference's JSON structure, much
    shorter than it), ``empty_fields``, ``no_reference_keys``, ``repetition``, ``prompt_copy``; [] for an honest
    answer."""
    found = []
    truth = reference_value(reference)
    parsed = find_json(answer)
    value = parsed[0] if parsed else None
    structured = truth is not None and isinstance(value, type(truth))
    if not structured and len(answer.strip()) < rules.min_length_ratio * len(_compact(reference)):
        found.append("too_short")  # a partial answer in the reference's structure is judged by the checks below
    if truth is not None and isinstance(value, (dict, list)):
        if is_empty(value) and not is_empty(truth):
            found.append("empty_fields")
        if isinstance(truth, dict) and isinstance(value, dict) and value and not set(value) & set(truth):
            found.append("no_reference_keys")
    words, reference_words, n = tokens(_body(answer)), tokens(_body(reference)), rules.ngram
    if repetition(words, n) > max(rules.max_repetition, repetition(reference_words, n) + REPETITION_MARGIN):
        found.append("repetition")
    if prompt:
        known = set(ngrams(reference_words, n))
        new = [gram for gram in ngrams(words, n) if gram not in known]
        from_prompt = set(ngrams(tokens(prompt), n))
        if len(new) >= 2 and sum(gram in from_prompt for gram in new) / len(new) >= rules.max_copy:
            found.append("prompt_copy")
    return found
