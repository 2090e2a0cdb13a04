"""Issue 51, class 5: an answer longer than a model writes is a parse failure, found by a linear count before any
parsing (one answer of 100,000 boxes stalled eval for minutes: matching and the duplicate monitor are quadratic in
one answer). The bound's premise, the fewest tokens an item takes, is checked against the Qwen pre-tokenizer."""

from __future__ import annotations

import json
import re

import pytest

from llamafactory_qwenvl_patch.frame.families import SPECIAL_TOKENS
from llamafactory_qwenvl_patch.scoring import json_text
from llamafactory_qwenvl_patch.scoring.answers import (
    MAX_ANSWER_ITEMS,
    MIN_ITEM_TOKENS,
    too_many_items,
    try_parse_items,
)
from llamafactory_qwenvl_patch.scoring.temporal import try_parse_spans, try_parse_track

ITEMS = {  # the densest way to write each kind of item the parsers read, as a list of 20
    "point": "[" + ",".join(['{"point_2d":[0,0]}'] * 20) + "]",
    "box": "[" + ",".join(['{"bbox_2d":[0,0,0,0]}'] * 20) + "]",
    "point and box in one object": "[" + ",".join(['{"point_2d":[0,0],"bbox_2d":[0,0,0,0]}'] * 10) + "]",
    "box tokens": "<|box_start|>(0,0),(0,0)<|box_end|>" * 20,
    "span": "[" + ",".join(['{"span":[0,0]}'] * 20) + "]",
    "track entry": "[" + ",".join(['{"time":0,"bbox_2d":[0,0,0,0]}'] * 20) + "]",
}


def fewest_tokens(pre_tokenizer, text: str) -> int:
    """The fewest tokens any BPE vocabulary over this pre-tokenizer gives ``text``: one per special token, one per
    pre-token of the text between them (BPE never merges across pre-tokens)."""
    pieces = re.split("|".join(map(re.escape, SPECIAL_TOKENS)), text)
    return len(pieces) - 1 + sum(len(pre_tokenizer.pre_tokenize_str(piece)) for piece in pieces if piece)


@pytest.mark.parametrize("kind", ITEMS)
def test_no_item_takes_fewer_tokens_than_the_bound_assumes(kind):
    from qwenvl_prep.demos.tiny_model import build_tokenizer

    pre_tokenizer = build_tokenizer().backend_tokenizer.pre_tokenizer  # the real Qwen2 tokenizer's split
    assert fewest_tokens(pre_tokenizer, ITEMS[kind]) / 20 >= MIN_ITEM_TOKENS


ENCODINGS = {  # every way of writing the keys that the parsers read as those keys
    "plain": lambda text: text,
    "keys as unicode escapes": lambda text: text.replace('"bbox_2d"', '"\\u0062box_2d"').replace('"span"',
                                                                                               '"sp\\u0061n"'),
    "double-encoded": json.dumps,
}


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_an_answer_over_the_bound_is_a_parse_failure_found_before_parsing(encoding, monkeypatch):
    """At the bound every encoding parses in full; past it the linear count refuses it before the parser runs
    (keys written as ``\\u`` escapes once passed the count and were matched in quadratic time)."""
    encode = ENCODINGS[encoding]
    at_bound = encode(json.dumps([{"bbox_2d": [k % 900, 1, 950, 960]} for k in range(MAX_ANSWER_ITEMS)]))
    assert len(try_parse_items(at_bound)) == MAX_ANSWER_ITEMS and too_many_items(at_bound) is None
    spans_at_bound = encode(json.dumps([{"span": [0, 1]}] * MAX_ANSWER_ITEMS))
    assert len(try_parse_spans(spans_at_bound)) == MAX_ANSWER_ITEMS
    hostile = encode(json.dumps([{"bbox_2d": [1, 2, 3, 4]}] * 100_000))
    spans = encode(json.dumps([{"span": [0, 1]}] * (MAX_ANSWER_ITEMS + 1)))

    def no_parse(*args, **kwargs):
        raise AssertionError("the parser ran on an answer the count refuses")

    monkeypatch.setattr(json_text, "embedded", no_parse)
    assert "more than a model writes" in too_many_items(hostile)
    assert try_parse_items(hostile) is None and try_parse_track(hostile) is None and try_parse_spans(spans) is None
