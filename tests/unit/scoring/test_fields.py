"""Field extraction: value comparison, partial credit, the no_cheat detectors and the blank-image confidence test."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamafactory_qwenvl_patch.grpo.rewards.builtin import (
    BUILTIN,
    confident_answer,
    fields_raw_reward,
    fields_reward,
    no_cheat_reward,
)
from llamafactory_qwenvl_patch.grpo.rewards.registry import load_rewards
from llamafactory_qwenvl_patch.scoring.cheats import CheatRules, cheats
from llamafactory_qwenvl_patch.scoring.fields import as_date, as_number, find_json, reference_value, score_fields

INVOICE = {"invoice_number": "INV-2024-0042", "date": "2024-06-18", "amount": "1,234.50", "vendor": "ACME GmbH"}
REFERENCE = json.dumps(INVOICE)
PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Read the invoice and answer in JSON: "
          '{"invoice_number": "...", "date": "YYYY-MM-DD", "amount": "...", "vendor": "..."}<|im_end|>\n'
          "<|im_start|>assistant\n")


@pytest.mark.parametrize("reference, answer", [
    (300, "300.00"), ("300", 300.0), ("$1,234.50", "1234.5"), ("1234.50 EUR", "€1,234.5"), (-2, "-2.0"),
])
def test_numbers_compare_by_value(reference, answer):
    assert as_number(reference) == as_number(answer) is not None


@pytest.mark.parametrize("text", ["007", "INV-1", "1.2.3", "12,34", "", "nan", "1e5"])
def test_identifiers_and_odd_text_are_not_numbers(text):
    assert as_number(text) is None


@pytest.mark.parametrize("answer", ["2024/06/18", "2024.6.18", "18 June 2024", "Jun 18, 2024", "june 18 2024"])
def test_dates_compare_by_day(answer):
    assert as_date(answer) == as_date("2024-06-18") is not None


@pytest.mark.parametrize("text", ["06/07/2024", "2024-02-30", "2024-13-01", "18 Juneteenth 2024", "2024-06"])
def test_ambiguous_or_invalid_dates_are_not_dates(text):
    assert as_date(text) is None


def test_partial_credit_per_leaf_and_format():
    truth = reference_value(REFERENCE)
    exact = score_fields(REFERENCE, truth)
    assert exact.raw == pytest.approx(5.0) and exact.normalised == pytest.approx(1.0) and exact.exact
    same_values = score_fields('```json\n{"invoice_number": "inv-2024-0042", "date": "2024/06/18", '
                               '"amount": 1234.5, "vendor": "Acme  GmbH."}\n```', truth)
    assert same_values.normalised == pytest.approx(1.0)
    one_wrong = score_fields('{"invoice_number": "INV-2024-0043", "date": "2024-06-18", "amount": "1234.50", '
                             '"vendor": "ACME GmbH"}', truth)
    assert one_wrong.raw == pytest.approx(4.3)  # 3 leaves x 1.0 + 0.3 filled + 1 format
    in_prose = score_fields('Sure! {"invoice_number": "INV-2024-0042"} hope that helps', truth)
    assert in_prose.parsed and not in_prose.format_ok and in_prose.raw == pytest.approx(1.0)
    garbage = score_fields("no idea", truth)
    assert garbage.raw == 0 and not garbage.parsed


def test_nested_objects_and_line_items_get_credit_per_leaf_in_any_order():
    truth = {"total": 30, "seller": {"name": "A", "vat": ""},
             "items": [{"name": "bolt", "qty": 2}, {"name": "nut", "qty": 3}]}
    swapped = {"total": "30.00", "seller": {"name": "a"},
               "items": [{"name": "nut", "qty": 3}, {"name": "bolt", "qty": "2"}]}
    score = score_fields(json.dumps(swapped), truth)
    paths = [leaf.path for leaf in score.leaves]
    assert paths == ["total", "seller.name", "seller.vat", "items[].name", "items[].qty", "items[].name",
                     "items[].qty"]
    assert all(leaf.equal for leaf in score.leaves)  # vat: empty in the document and absent in the answer
    assert score.raw == pytest.approx(6 * 1.0 + 0.7 + 1.0)
    hallucinated = score_fields(json.dumps({**swapped, "seller": {"name": "A", "vat": "DE123"}}), truth)
    vat = next(leaf for leaf in hallucinated.leaves if leaf.path == "seller.vat")
    assert vat.credit == 0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text("abcdef", min_size=1, max_size=4),
                                                                     children, max_size=4),
    max_leaves=12)


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=8), JSON_VALUES, min_size=1, max_size=6),
       JSON_VALUES)
def test_credit_bounds_and_exact_answer_scores_one(truth, answer):
    """Any answer (nested, lists of any length, wrong types) scores within [0, 1], and never above the reference
    itself, which scores 1."""
    score = score_fields(json.dumps(answer), truth)
    assert 0 <= score.normalised <= 1
    assert score_fields(json.dumps(truth), truth).normalised == pytest.approx(1.0)
    assert score.normalised <= score_fields(json.dumps(truth), truth).normalised


def test_fields_reward_normalised_and_raw():
    completions = [REFERENCE, '{"invoice_number": "INV-2024-0042"}', "nothing"]
    refs = [REFERENCE] * 3
    assert fields_reward(completions, references=refs) == pytest.approx([1.0, 2.0 / 5, 0.0])
    assert fields_raw_reward(completions, references=refs) == pytest.approx([5.0, 2.0, 0.0])
    assert fields_reward(["x"], references=["a plain text answer"]) == [0.0]


HACKS = {
    "empty object": "{}",
    "spaced empty object": "   {}",
    "empty fields": '{"invoice_number": "", "date": "", "amount": "", "vendor": ""}',
    "foreign keys": '{"answer": "INV-2024-0042 2024-06-18 1234.50 ACME GmbH", "note": "see image"}',
    "repeated lines": "\n".join(['{"invoice_number": "INV-1"}'] * 12),
    "repeated words": "total total total total total total total total total total total total total total",
    "template copied": '{"invoice_number": "...", "date": "YYYY-MM-DD", "amount": "...", "vendor": "..."}',
    "question copied": "Read the invoice and answer in JSON",
}
HONEST = {
    "exact": REFERENCE,
    "fenced pretty": "```json\n" + json.dumps(INVOICE, indent=2) + "\n```",
    "one wrong value": REFERENCE.replace("0042", "0043"),
    "reordered": json.dumps(dict(reversed(list(INVOICE.items())))),
    "all values wrong": json.dumps({"invoice_number": "INV-1999-0001", "date": "2023-01-02", "amount": "99.00",
                                    "vendor": "Foo Ltd"}),
    "missing one field": json.dumps({k: v for k, v in INVOICE.items() if k != "vendor"}),
}


@pytest.mark.parametrize("name", HACKS)
def test_no_cheat_penalises_each_hack(name):
    assert cheats(HACKS[name], REFERENCE, PROMPT), name
    assert no_cheat_reward([HACKS[name]], references=[REFERENCE], prompts=[PROMPT]) == [-1.0]


@pytest.mark.parametrize("name", HONEST)
def test_no_cheat_never_penalises_honest_answers(name):
    assert cheats(HONEST[name], REFERENCE, PROMPT) == []


def test_no_cheat_honest_line_items_are_not_repetition():
    items = [{"description": f"item {i}", "qty": 1, "unit_price": "9.99"} for i in range(15)]
    reference = json.dumps({"invoice_number": "A1", "items": items})
    answer = {"items": [{**item, "qty": 2} if i % 4 == 0 else item for i, item in enumerate(reversed(items))],
              "invoice_number": "A7"}
    assert cheats(json.dumps(answer, indent=1), reference, PROMPT) == []


def test_no_cheat_partial_structured_answers_are_not_too_short():
    reference = json.dumps({"seller_address": "Musterstrasse 1, 12345 Berlin, Germany", "notes": "Payable within "
                            "30 days of receipt, bank transfer only, quote the invoice number", "total": 300})
    for answer in ('{"total": 300}', '{"seller_address": null, "notes": null, "total": 300}'):
        assert "too_short" not in cheats(answer, reference)
    assert "too_short" in cheats("300", reference)


def test_no_cheat_thresholds_come_from_the_yaml_keys():
    strict = CheatRules(min_length_ratio=0.9)
    short = "INV-2024-0042, 2024-06-18, 1,234.50"
    assert cheats(short, REFERENCE, "", CheatRules()) == []
    assert "too_short" in cheats(short, REFERENCE, "", strict)
    reward = next(r for r in load_rewards("no_cheat", None, strict) if r.name == "no_cheat")
    assert reward.func([short], references=[REFERENCE]) == [-1.0]
    assert {"fields", "fields_raw", "no_cheat"} <= set(BUILTIN)


@pytest.mark.parametrize("answer, reference, expected", [
    (REFERENCE, REFERENCE, True),
    ('{"invoice_number": "X-1"}', REFERENCE, True),
    ("{}", REFERENCE, False),
    ('{"invoice_number": "", "date": null}', REFERENCE, False),
    ("I cannot read an invoice in this image.", REFERENCE, False),
    ('[{"bbox_2d": [1, 2, 30, 40], "label": "cat"}]', '[{"bbox_2d": [5, 5, 50, 50], "label": "cat"}]', True),
    ("There is no cat.", '[{"bbox_2d": [5, 5, 50, 50], "label": "cat"}]', False),
])
def test_confident_answer(answer, reference, expected):
    assert confident_answer(answer, reference) is expected


def test_hostile_answers_never_raise_or_stall():
    """Deep nesting (RecursionError inside json), a 400-digit integer (float overflow), a long run of spaces (the
    currency pattern) and a padded list: each scores quickly, without an exception."""
    assert find_json("{" * 20000) is None
    assert find_json("[" * 5000 + "]" * 5000) is None
    assert find_json("[" + "1," * 5 + "2]") == ([1, 1, 1, 1, 1, 2], True)
    truth = {"total": 300}
    assert score_fields('{"total": ' + "9" * 400 + "}", truth).raw == pytest.approx(1.3)
    assert confident_answer('{"total": ' + "9" * 400 + "}", json.dumps(truth))
    assert as_number("1" + " " * 50000 + "1") is None and as_date(" " * 50000) is None
    assert fields_reward(["[" * 5000], references=[REFERENCE]) == [0.0]


def test_padding_a_list_with_guesses_does_not_pay():
    truth = {"items": [{"qty": 1}, {"qty": 2}]}
    exact = score_fields(json.dumps(truth), truth)
    padded = score_fields(json.dumps({"items": [{"qty": q} for q in range(100)]}), truth)
    assert exact.normalised == pytest.approx(1.0) and exact.exact
    assert padded.normalised < 0.2 and not padded.exact
    letters = score_fields(json.dumps(list("abcdefghijklmnopqrstuvwxyz")), ["a", "b"])
    assert letters.normalised < 0.5 and not letters.exact


@pytest.mark.parametrize("value", ["N/A", "unknown", "Not visible", None, ""])
def test_written_abstentions_are_not_confident(value):
    assert not confident_answer(json.dumps({"invoice_number": value, "date": value}), REFERENCE)


def test_format_wants_the_json_alone():
    refs = [REFERENCE] * 3
    answers = [REFERENCE, "```json\n" + REFERENCE + "\n```", "Sure, here it is: " + REFERENCE + " hope this helps"]
    assert BUILTIN["format"](answers, references=refs) == [1.0, 1.0, 0.0]
