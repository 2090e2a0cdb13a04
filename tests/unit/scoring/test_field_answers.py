"""Field answers (issue 41, item 9): a repeated key is a parse failure, as in every other answer parser, and an
abstention is recognised by a rule (``fields.is_abstention``: every word from a small vocabulary of absence words),
not by a list, in the rewards and in the blank-image control (``confident_answer``, what the trainer penalises)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamafactory_qwenvl_patch.grpo.rewards.builtin import (
    BUILTIN,
    confident_answer,
    fields_reward,
    format_reward,
    json_fields_reward,
)
from llamafactory_qwenvl_patch.scoring.answers import try_parse_items
from llamafactory_qwenvl_patch.scoring.cheats import cheats
from llamafactory_qwenvl_patch.scoring.fields import is_empty, score_fields

REFERENCE = json.dumps({"invoice_number": "INV-7", "vendor": "ACME GmbH"})

# --- repeated keys ---------------------------------------------------------------------------------------------

REPEATED = [
    '{"invoice_number": "INV-9", "invoice_number": "INV-7", "vendor": "ACME GmbH"}',
    '```json\n{"invoice_number": "INV-7", "vendor": "X", "vendor": "ACME GmbH"}\n```',
    'Here: {"invoice_number": "INV-7", "vendor": "ACME GmbH", "vendor": "ACME GmbH"}',
    '{"invoice_number": "INV-7", "vendor": "ACME GmbH", "meta": {"a": 1, "a": 2}}',
]


@pytest.mark.parametrize("answer", REPEATED)
def test_repeated_keys_score_zero_like_every_other_parser(answer):
    """``json.loads`` keeps the last value, so the first answer scored 1.0; the grounding parser refuses the same."""
    refs = [REFERENCE]
    assert fields_reward([answer], references=refs) == [0.0]
    assert format_reward([answer], references=refs) == [0.0]
    assert json_fields_reward([answer], references=refs) == [0.0]
    assert not score_fields(answer, json.loads(REFERENCE)).parsed
    assert try_parse_items('[{"bbox_2d": [1, 2, 3, 4], "bbox_2d": [1, 2, 3, 5]}]') is None  # the others' rule


def test_the_same_answer_without_the_repeat_still_scores():
    answer = '{"invoice_number": "INV-7", "vendor": "ACME GmbH"}'
    assert fields_reward([answer], references=[REFERENCE]) == [1.0]
    assert BUILTIN["format"]([answer], references=[REFERENCE]) == [1.0]


# --- abstentions -----------------------------------------------------------------------------------------------

ABSTAINING = ["—", "–", "n.a.", "not legible", "none found", "unk", "N/A", "n/a", "NA", "#N/A", "-", "--", "?",
              "...", "None", "NULL", "nil", "unknown", "Unknown.", "not visible", "Not available", "not applicable",
              "can't read", "can’t read", "cannot be read", "unable to read", "illegible", "no data", "No value",
              "none visible", "missing", "blank", "(empty)", "[not found]", "N.A", "n/k", "", "   "]
VALUES = ["No. 5 Main St", "Nothing Ltd", "0", "NA-123", "No", "Not", "A", "N", "Unknown Pleasures", "None Such",
          "Visible Ltd", "Available", "found", "UK", "n/a 5", "nan", "INV-7", "Null Island Trading", "Blank Street 4",
          "X", "-5", "?1"]


def all_fields(value: str) -> str:
    return json.dumps({"invoice_number": value, "vendor": value})


@pytest.mark.parametrize("value", ABSTAINING)
def test_abstentions_are_not_confident_on_a_blank_image(value):
    """The blank-image control penalises a confident answer (``confident_answer``); these say "nothing there"."""
    assert is_empty(value)
    assert not confident_answer(all_fields(value), REFERENCE)
    assert "empty_fields" in cheats(all_fields(value), REFERENCE)  # on a real image still an empty answer


@pytest.mark.parametrize("value", VALUES)
def test_values_are_never_taken_for_abstentions(value):
    assert not is_empty(value)
    assert confident_answer(all_fields(value), REFERENCE)


def test_a_reference_abstention_is_a_blank_field():
    truth = {"invoice_number": "—", "vendor": "ACME GmbH"}
    assert score_fields(json.dumps({"invoice_number": "n.a.", "vendor": "ACME GmbH"}), truth).exact
    assert score_fields(json.dumps({"vendor": "ACME GmbH"}), truth).normalised < 1
    assert not score_fields(json.dumps({"invoice_number": "INV-7", "vendor": "ACME GmbH"}), truth).exact


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12), st.integers(0, 9), st.text(max_size=12))
def test_text_with_a_digit_is_a_value(before, digit, after):
    """Numbers, identifiers, addresses, dates: a digit anywhere makes a value."""
    assert not is_empty(f"{before}{digit}{after}")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ABSTAINING[:-2]), st.sampled_from(["", " ", "  ", "\t", "\n"]),
       st.sampled_from(["", ".", "!", "?", ")", ":", "…", "*"]), st.booleans())
def test_abstentions_survive_case_space_and_punctuation(phrase, space, mark, upper):
    text = space + (phrase.upper() if upper else phrase) + mark + space
    assert is_empty(text)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ABSTAINING[:-2]), st.from_regex(r"[A-Za-z]{2,10}", fullmatch=True), st.booleans())
def test_an_abstention_with_another_word_is_a_value(phrase, word, first):
    """A word outside the vocabulary (a name, a street) makes the whole text a value: "None Such", "Nothing Ltd"."""
    from llamafactory_qwenvl_patch.scoring.fields import ABSTENTION_WORDS

    if word.casefold() in ABSTENTION_WORDS:
        return
    assert not is_empty(f"{word} {phrase}" if first else f"{phrase} {word}")
