"""Field extraction answers (a JSON object per image): finding the JSON, comparing values, partial credit per leaf.

Pure functions shared by the ``fields`` reward, the blank-image control and ``qwenvl-prep eval``.

Credit rules (docs/fields.md): every leaf of the reference (nested objects are walked, lists of line
items are matched one-to-one to the answer's list so that order does not matter) earns ``FOUND`` when the answer
has it filled and ``EQUAL`` more when its value equals the reference's after normalisation; an answer that is exactly
one JSON value of the reference's type (bare or in one code fence) earns ``FORMAT``. Numbers compare by value and
dates by calendar day when the reference is clearly one (see ``as_number`` and ``as_date``); other text compares
case-, width- and whitespace-insensitively. A field written as an abstention (``is_abstention``: a rule over the
words, not a list of phrases) is empty; an answer that repeats a key is a parse failure, as in every answer parser.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import unicodedata
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from llamafactory_qwenvl_patch.scoring import json_text
from llamafactory_qwenvl_patch.scoring.answers import FENCE

FOUND, EQUAL, FORMAT = 0.3, 0.7, 1.0
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+")
_UNIT = r"(?:[$€£¥₹]|USD|EUR|GBP|CNY|RMB|JPY|CHF|INR)"
_CURRENCY = re.compile(rf"^{_UNIT}\s*|\s*{_UNIT}$", re.IGNORECASE)
_YMD = re.compile(r"(\d{4})[-/.](\d{1,2})[-/.](\d{1,2})")
_DMY_NAMED = re.compile(r"(\d{1,2})\s+([A-Za-z]{3,9})\.?,?\s+(\d{4})")
_MDY_NAMED = re.compile(r"([A-Za-z]{3,9})\.?\s+(\d{1,2}),?\s+(\d{4})")
_MONTHS = {name: i for i, names in enumerate(
    [("jan", "january"), ("feb", "february"), ("mar", "march"), ("apr", "april"), ("may",), ("jun", "june"),
     ("jul", "july"), ("aug", "august"), ("sep", "sept", "september"), ("oct", "october"), ("nov", "november"),
     ("dec", "december")], start=1) for name in names}
_MISSING = object()
_MAX_STARTS = 16  # JSON start positions tried in prose (the first that reads wins); bounds the work on hostile outputs
_MAX_VALUE_CHARS = 64  # longer text is never a number or a date (and regexes stay linear)
_MAX_EXTRA_ITEMS = 4  # answer items considered for matching, in multiples of the reference's list length
# Abstentions (``is_abstention``, docs/fields.md): words that say a value is absent on their own, negations that need
# a word after them ("not legible"; a bare "No" is a yes/no answer), and the words such phrases are made of.
ABSENT_WORDS = frozenset({"none", "nothing", "na", "nk", "null", "nil", "unknown", "unk", "missing", "absent",
                          "blank", "empty", "illegible", "unreadable", "unclear", "unavailable", "unspecified",
                          "unidentified", "undetermined"})
NEGATIONS = frozenset({"no", "not", "cannot", "cant", "couldnt", "unable", "isnt", "wasnt", "dont", "doesnt"})
PHRASE_WORDS = frozenset({"legible", "readable", "visible", "available", "found", "present", "given", "applicable",
                          "provided", "shown", "specified", "stated", "detected", "known", "listed", "identified",
                          "recognised", "recognized", "determined", "clear", "read", "seen", "see", "value", "data",
                          "information", "info", "entry", "field", "be", "is", "was", "to", "can", "could", "do",
                          "does", "know", "i", "it"})
ABSTENTION_WORDS = ABSENT_WORDS | NEGATIONS | PHRASE_WORDS
_WORD = re.compile(r"[^\W_]+")  # a run of letters and digits
_APOSTROPHES = re.compile(r"['’ʼ`´]")  # dropped, so "can't" is one word: "cant"


def normalize(text: Any) -> str:
    """Case-, width- and whitespace-insensitive form for exact matching (code fences and end punctuation dropped)."""
    text = unicodedata.normalize("NFKC", str(text))
    fence = FENCE.search(text)
    text = fence.group(1) if fence else text
    return " ".join(text.casefold().split()).strip(" .;,")


def as_number(value: Any) -> Decimal | None:
    """The value of a JSON number, or of a string that is only a number: optional sign, ``1,234.50`` style
    thousands separators, an optional currency symbol or code. Strings with a leading zero (``007``) are
    identifiers, not numbers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        return Decimal(str(value)) if math.isfinite(value) else None
    if not isinstance(value, str) or len(value) > _MAX_VALUE_CHARS:
        return None
    text = _CURRENCY.sub("", unicodedata.normalize("NFKC", value).strip()).strip()
    if not _NUMBER.fullmatch(text):
        return None
    digits = text.lstrip("+-")
    if len(digits) > 1 and digits[0] == "0" and digits[1].isdigit():
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def as_date(value: Any) -> dt.date | None:
    """A calendar day written year first (``2024-06-18``, ``2024/6/18``, ``2024.06.18``) or with an English month
    name (``18 June 2024``, ``Jun 18, 2024``); ambiguous day/month orders such as ``06/07/2024`` are not dates."""
    if not isinstance(value, str) or len(value) > _MAX_VALUE_CHARS:
        return None
    text = value.strip()
    for pattern, order in ((_YMD, "ymd"), (_DMY_NAMED, "dmy"), (_MDY_NAMED, "mdy")):
        match = pattern.fullmatch(text)
        if not match:
            continue
        parts = dict(zip(order, match.groups()))
        month = parts["m"]
        month = int(month) if month.isdigit() else _MONTHS.get(month.casefold())
        try:
            return dt.date(int(parts["y"]), month, int(parts["d"])) if month else None
        except ValueError:
            return None
    return None


def _words(text: str) -> list[str]:
    """The words of a text, case-folded (NFKC): runs of letters and digits, apostrophes dropped; a whitespace-free
    chunk of one-letter runs is one word, so ``N/A``, ``n.a.`` and ``#N/A`` are all ``na``."""
    text = _APOSTROPHES.sub("", unicodedata.normalize("NFKC", text).casefold())
    out: list[str] = []
    for chunk in text.split():
        runs = _WORD.findall(chunk)
        out += ["".join(runs)] if len(runs) > 1 and all(len(run) == 1 for run in runs) else runs
    return out


def is_abstention(text: str) -> bool:
    """Text that says "no value here" rather than giving one: no words at all (blank, ``-``, ``—``, ``?``), or only
    words of ``ABSTENTION_WORDS`` with at least one of ``ABSENT_WORDS`` (``unk``, ``none found``) or a negation and
    another word (``not legible``, ``can't read``). Any other word or any digit makes a value: ``No. 5 Main St``,
    ``Nothing Ltd``, ``NA-123``, ``0``, and a bare ``No`` (a yes/no answer)."""
    found = _words(text)
    if not all(word in ABSTENTION_WORDS for word in found):
        return False
    return not found or any(word in ABSENT_WORDS for word in found) or (
        len(found) > 1 and any(word in NEGATIONS for word in found))


def is_empty(value: Any) -> bool:
    """No content: null, an abstention (``is_abstention``: blank text, ``N/A``, ``—``, ``not legible``), or a
    container whose leaves are all empty."""
    if value is None or value is _MISSING:
        return True
    if isinstance(value, str):
        return is_abstention(value)
    if isinstance(value, dict):
        return all(is_empty(v) for v in value.values())
    if isinstance(value, list):
        return all(is_empty(v) for v in value)
    return False


def values_equal(reference: Any, answer: Any) -> bool:
    """Equality after normalisation: by value for numbers, by day for dates, else normalised text."""
    number = as_number(reference)
    if number is not None:
        return as_number(answer) == number
    day = as_date(reference)
    if day is not None:
        return as_date(answer) == day
    if isinstance(reference, bool) or isinstance(answer, bool):
        return str(reference).casefold() == str(answer).casefold()
    return normalize(reference) == normalize(answer)


class _Refused(Exception):
    """JSON that cannot be taken as written: nested deeper than ``json_text.MAX_DEPTH`` (the walks below recurse once
    per level), or with a repeated key (``json.loads`` keeps the last value; every answer parser refuses it)."""


_DECODER = json.JSONDecoder(object_pairs_hook=json_text.unique_keys)


def _bounded(value: Any) -> Any:
    if json_text.depth(value) > json_text.MAX_DEPTH:
        raise _Refused
    return value


def _json(text: str) -> Any:
    """The JSON value of ``text`` (Python's numbers), ``_MISSING`` when the text is not JSON."""
    try:
        return _bounded(_DECODER.decode(text))
    except (RecursionError, json_text.DuplicateKeyError):
        raise _Refused from None
    except ValueError:
        return _MISSING


def find_json(text: str) -> tuple[Any, bool] | None:
    """(the JSON value of an answer, whether the answer is exactly that value): a code fence, the whole text, or
    else the first object or array embedded in prose; None when there is none, or when it nests deeper than
    ``json_text.MAX_DEPTH`` or repeats a key (a parse failure, never a RecursionError)."""
    try:
        return _find_json(text)
    except _Refused:
        return None


def _find_json(text: str) -> tuple[Any, bool] | None:
    stripped = text.strip()
    fences = FENCE.findall(text)
    if fences:
        value = _json(fences[0])
        if value is not _MISSING:
            return value, len(fences) == 1 and FENCE.fullmatch(stripped) is not None
    value = _json(stripped)
    if value is not _MISSING:
        return value, True
    try:
        for _, _, value in json_text.embedded(text, _DECODER.raw_decode, _MAX_STARTS):
            return _bounded(value), False
    except (RecursionError, json_text.DuplicateKeyError):
        raise _Refused from None
    return None


@dataclass(frozen=True)
class Leaf:
    """One reference leaf against the answer: ``path`` like ``total`` or ``items[].qty``; ``found``: filled (for
    an empty reference leaf: present and empty); ``equal``: same value after normalisation (for an empty reference
    leaf: empty or absent)."""

    path: str
    found: bool
    equal: bool
    blank: bool = False  # the reference leaves this field empty

    @property
    def credit(self) -> float:
        return FOUND * self.found + EQUAL * self.equal


def _leaf(path: str, reference: Any, answer: Any) -> Leaf:
    if is_empty(reference):  # the document has no such value: an empty or absent answer is right
        if answer is _MISSING:
            return Leaf(path, False, True, blank=True)
        return Leaf(path, is_empty(answer), is_empty(answer), blank=True)
    if answer is _MISSING or is_empty(answer) or isinstance(answer, (dict, list)):
        return Leaf(path, False, False)
    return Leaf(path, True, values_equal(reference, answer))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def compare(reference: Any, answer: Any, path: str = "") -> list[Leaf]:
    """Every leaf of ``reference`` scored against ``answer`` (``_MISSING`` where the answer lacks it)."""
    if isinstance(reference, dict) and reference:
        return [leaf for key, value in reference.items()
                for leaf in compare(value, answer.get(key, _MISSING) if isinstance(answer, dict) else _MISSING,
                                    _join(path, str(key)))]
    if isinstance(reference, list) and reference:
        return _compare_lists(reference, answer if isinstance(answer, list) else [], f"{path}[]")
    return [_leaf(path, reference, answer)]


def _compare_lists(reference: list, answer: list, path: str) -> list[Leaf]:
    """Line items matched one-to-one (maximum total credit, so their order does not matter); unmatched reference
    items are compared with nothing, and each answer item beyond the reference's count adds wrong leaves (the
    shape of a reference item), so padding a list with guesses never pays."""
    extra = max(0, len(answer) - len(reference))
    answer = answer[:_MAX_EXTRA_ITEMS * len(reference)]  # bounds the matching work; the rest are extra anyway
    leaves: list[Leaf] = []
    matched: dict[int, int] = {}
    pairs: list[list[list[Leaf]]] = []
    if answer:
        from scipy.optimize import linear_sum_assignment

        pairs = [[compare(r, a, path) for a in answer] for r in reference]
        scores = [[sum(leaf.credit for leaf in pair) for pair in row] for row in pairs]
        rows, cols = linear_sum_assignment(scores, maximize=True)
        matched = dict(zip(rows.tolist(), cols.tolist()))
    for i, item in enumerate(reference):
        leaves += pairs[i][matched[i]] if i in matched else compare(item, _MISSING, path)
    if not extra:
        return leaves
    shape = [Leaf(leaf.path, False, False) for leaf in compare(reference[0], _MISSING, path)]
    return leaves + shape * extra


@dataclass(frozen=True)
class FieldScore:
    """One answer against its reference: per-leaf results, whether it parsed, and whether it is exactly one JSON
    value of the reference's type. ``raw`` is in [0, leaves + 1]; ``normalised`` in [0, 1]."""

    leaves: tuple[Leaf, ...]
    parsed: bool
    format_ok: bool

    @property
    def raw(self) -> float:
        return sum(leaf.credit for leaf in self.leaves) + FORMAT * self.format_ok

    @property
    def maximum(self) -> float:
        return (FOUND + EQUAL) * len(self.leaves) + FORMAT

    @property
    def normalised(self) -> float:
        return self.raw / self.maximum

    @property
    def exact(self) -> bool:
        return self.parsed and all(leaf.equal for leaf in self.leaves)


def reference_value(reference: str) -> Any:
    """The reference answer's JSON object or array, or None when it is not field extraction."""
    found = find_json(reference)
    if found is None or not isinstance(found[0], (dict, list)) or not found[0]:
        return None
    return found[0]


def score_fields(answer: str, reference: Any) -> FieldScore:
    """Score ``answer`` (model text) against a reference object or array (``reference_value``)."""
    found = find_json(answer)
    if found is None or not isinstance(found[0], type(reference)):
        return FieldScore(tuple(compare(reference, _MISSING)), False, False)
    value, whole = found
    return FieldScore(tuple(compare(reference, value)), True, whole)


def confident(answer: str, reference: Any) -> bool:
    """The answer commits to content in the reference's structure: a JSON value of its type with at least one
    leaf filled that the reference fills too. What an answer without looking at the image must not be."""
    return any(leaf.found and not leaf.blank for leaf in score_fields(answer, reference).leaves)
