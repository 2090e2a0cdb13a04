"""Issue 51, class 7: Qwen-VL's own special tokens in a record's text. A benchmark instruction holding
``<|image_pad|>`` converted and checked clean, then predict stopped with an IndexError from the processor naming no
record. The chat and media tokens are now refused wherever the media tags are (convert, check, predict), from one
list that each family's tokenizer is checked against; the grounding tokens stay text a record may hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import save_image
from hostile import POLICY, RECORD, run_convert

from llamafactory_qwenvl_patch.frame.families import SPECIAL_TOKENS, STRUCTURE_TOKENS
from qwenvl_prep.cli import main

FAMILY_MODELS = ["tiny_model", "tiny_model_qwen2", "tiny_model_qwen3", "tiny_model_qwen3_5"]


@pytest.mark.parametrize("fixture", FAMILY_MODELS)
def test_the_list_is_every_special_token_of_each_family(request, fixture):
    """The fixed list (convert and check have no tokenizer) against each family's tokenizer as its processor loads
    it: every ``<|...|>`` special token, no more, no less."""
    from transformers import AutoProcessor

    tokenizer = AutoProcessor.from_pretrained(request.getfixturevalue(fixture)).tokenizer
    found = set(tokenizer.all_special_tokens) | {str(t) for t in tokenizer.added_tokens_decoder.values() if t.special}
    assert {t for t in found if t.startswith("<|") and t.endswith("|>")} == set(SPECIAL_TOKENS)


def test_convert_names_each_record_and_keeps_the_grounding_syntax(tmp_path):
    save_image(tmp_path / "ok.jpg", 640, 480)
    bad = [{**RECORD, "question": f"Click {token} here."} for token in STRUCTURE_TOKENS]
    referring = {**RECORD, "question": "Find <|object_ref_start|>the box<|object_ref_end|>."}
    code, out = run_convert(tmp_path, [RECORD, referring, *bad], "--input-coords", "abs", "--skip-bad")
    assert code == 0 and len(json.loads(out.read_text())) == 2
    rows = [json.loads(line) for line in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    assert [row["record"] for row in rows] == list(range(2, 2 + len(STRUCTURE_TOKENS)))
    for row, token in zip(rows, STRUCTURE_TOKENS):
        assert f"its user turn holds {token}, one of Qwen-VL's own special tokens" in row["error"], row


def test_convert_refuses_a_prompt_template_holding_one(tmp_path, capsys):
    src = tmp_path / "ss.json"
    src.write_text(json.dumps([{"img_filename": "ok.jpg", "instruction": "x", "bbox": [1, 2, 3, 4]}]))
    assert main(["convert", str(src), "-o", str(tmp_path / "o.json"), "--format", "screenspot", "--prompt",
                 "{instruction}<|vision_start|>", "--min-pixels", str(POLICY.min_pixels), "--max-pixels",
                 str(POLICY.max_pixels), "-q"]) == 2
    assert "holds <|vision_start|>" in capsys.readouterr().err


@pytest.fixture()
def poisoned(tmp_path) -> Path:
    """A dataset written by hand (not by convert): record 1's instruction holds an image pad."""
    save_image(tmp_path / "data" / "ok.jpg", 640, 480)
    good = {"messages": [{"role": "user", "content": "<image>Where?"},
                         {"role": "assistant", "content": '[{"bbox_2d": [1, 2, 30, 40]}]'}], "images": ["ok.jpg"]}
    bad = json.loads(json.dumps(good).replace("Where?", "Where is <|image_pad|>?"))
    (tmp_path / "data" / "bench.json").write_text(json.dumps([good, bad]))
    return tmp_path / "data" / "bench.json"


def test_check_reports_the_record(poisoned, tmp_path, capsys):
    yaml = tmp_path / "train.yaml"
    yaml.write_text(f"template: qwen2_vl\nimage_min_pixels: {POLICY.min_pixels}\nimage_max_pixels: "
                    f"{POLICY.max_pixels}\nqwenvl_patch: true\ncutoff_len: 4096\n")
    assert main(["check", str(poisoned), "--yaml", str(yaml), "--json"]) == 1
    [problem] = json.loads(capsys.readouterr().out)[0]["problems"]
    assert problem["sample"] == 1 and "holds <|image_pad|>" in problem["error"]


def test_predict_names_the_record_before_anything_loads(poisoned, tmp_path, capsys):
    """The model folder is empty: the record is named before a model (or a processor) is read."""
    model = tmp_path / "model"
    model.mkdir()
    assert main(["predict", str(model), "--dataset", str(poisoned), "-o", str(tmp_path / "p.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"record 1 of {poisoned} cannot be asked: its user turn holds <|image_pad|>" in err
    image = tmp_path / "data" / "ok.jpg"
    assert main(["predict", str(model), str(image), "--prompt", "Find <|video_pad|>", "-o",
                 str(tmp_path / "p.jsonl")]) == 2
    assert "--prompt holds <|video_pad|>" in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl.partial").exists()
