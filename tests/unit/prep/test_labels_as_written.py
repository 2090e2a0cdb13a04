"""Issue 22, items 1, 2, 3 and 5: the text a user wrote reaches training byte for byte except the coordinates convert
rewrites; every turn's coordinates are converted and `check` agrees; deep nesting is one error row (or one parse
failure), never an abort; what convert writes, LF's own loader accepts, and what it cannot carry is an error row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import lf_sft_dataset, save_image
from hypothesis import given, settings
from hypothesis import strategies as st
from qwenvl_prep.cli import main

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.scoring.answers import parse_answer, parse_items

MIN, MAX = 128 * 28 * 28, 512 * 28 * 28  # helpers.train_config's bounds, so LF's loader accepts the stamp
POLICY = ResizePolicy(MIN, MAX)
FLAGS = ["--min-pixels", str(MIN), "--max-pixels", str(MAX), "-q", "--workers", "1"]
DEEP = "[" * 400 + "]" * 400


def convert(tmp_path: Path, lines: list, *extra: str, name: str = "train.jsonl", suffix: str = ".jsonl"):
    """Write ``lines`` (records or raw text) as JSONL or a JSON array, convert them; (code, output, error rows)."""
    texts = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    src = tmp_path / f"in{suffix}"
    src.write_text("\n".join(texts) + "\n" if suffix == ".jsonl" else "[\n" + ",\n".join(texts) + "\n]\n")
    out = tmp_path / "data" / name
    code = main(["convert", str(src), "-o", str(out), *FLAGS, *extra])
    errors_path = Path(f"{out}.errors.jsonl")
    errors = {row["record"]: row["error"] for row in map(json.loads, errors_path.read_text().splitlines())} \
        if errors_path.exists() else {}
    return code, out, errors


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture()
def photo(tmp_path) -> Path:
    return save_image(tmp_path / "photo.jpg", 2000, 1000)


def model_box(box: list[int]) -> list[int]:
    return [int(v) for v in convert_coords(box, "orig", "model", (1000, 2000), POLICY.model_size(1000, 2000))]


# --- item 1: numbers and keys as written ------------------------------------------------------------------------

FIELDS = '{"total": 300.00, "tax": 1e2, "id": 123456789012345678901234567890, "neg": -0.0, "e": 1E+2, "s": "\\u00e9"}'


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_field_answers_and_meta_keep_their_numbers_as_written(tmp_path, photo, capsys, suffix):
    """Was: 300.00 -> 300.0, 1e2 -> 100.0, a 90-bit integer -> 1.2345678901234568e+29 (JSONL via orjson, JSON
    arrays via ijson)."""
    line = f'{{"image": "photo.jpg", "question": "Fields?", "answer": {FIELDS}, "meta": {{"rate": 0.50}}}}'
    code, out, errors = convert(tmp_path, [line], suffix=suffix)
    assert code == 0, errors
    [record] = records(out)
    assert record["messages"][1]["content"] == FIELDS.replace(": ", ":").replace(", ", ",").replace("\\u00e9", "é")
    assert record["meta"] == '{"rate": 0.50}'


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_duplicate_keys_are_error_rows_naming_the_key(tmp_path, photo, capsys, suffix):
    """Was: the last value kept, so a box vanished, also inside a string answer."""
    boxes = '[{"bbox_2d": [10, 20, 300, 400]}, {"bbox_2d": [10, 20, 300, 400], "bbox_2d": [50, 60, 700, 800]}]'
    lines = [{"image": "photo.jpg", "question": "Q", "answer": "[]"},
             '{"image": "photo.jpg", "question": "Q", "answer": {"total": 1, "total": 2}}',
             {"image": "photo.jpg", "question": "Q", "answer": boxes},
             '{"image": "photo.jpg", "question": "Q", "question": "R", "answer": "A"}']
    code, out, errors = convert(tmp_path, lines, "--input-coords", "abs", "--skip-bad", suffix=suffix)
    assert code == 0 and len(records(out)) == 1
    assert set(errors) == {1, 2, 3}
    for index, key in ((1, "total"), (2, "bbox_2d"), (3, "question")):
        assert f"the key '{key}' appears twice" in errors[index]


SPACING = st.sampled_from(["", " ", "  ", "\n"])
OTHER = st.sampled_from(["0.90", "1e2", "-0.0", "300.00", "123456789012345678901234567890", '"caf\\u00e9"', "null",
                         "true", '"a, b"'])


@st.composite
def answer_texts(draw) -> str:
    """Answers as people write them: boxes and points among other keys and numbers, any spacing, fenced or not,
    some inside prose or box tokens."""
    def box() -> str:
        kind, arity = draw(st.sampled_from([("bbox_2d", 4), ("point_2d", 2)]))
        values = draw(st.lists(st.integers(0, 900), min_size=arity, max_size=arity))
        sp = draw(SPACING)
        body = f"[{sp}" + f",{sp}".join(map(str, values)) + f"{sp}]"
        extra = [f'"{name}":{draw(SPACING)}{draw(OTHER)}' for name in draw(st.lists(st.sampled_from(["c", "d", "e"]),
                                                                                       unique=True, max_size=2))]
        return "{" + f",{draw(SPACING)}".join([f'"{kind}":{sp}{body}', *extra]) + "}"

    objects = "[" + f",{draw(SPACING)}".join(box() for _ in range(draw(st.integers(1, 3)))) + "]"
    form = draw(st.sampled_from(["bare", "fence", "prose", "tokens", "double"]))
    if form == "fence":
        return f"```json\n{objects}\n```"
    if form == "prose":
        return f"Here: {objects} (score 0.90)."
    if form == "double":
        return json.dumps(objects)
    if form == "tokens":
        x1, y1, x2, y2 = draw(st.lists(st.integers(0, 900), min_size=4, max_size=4))
        return f"<|object_ref_start|>a<|object_ref_end|><|box_start|>({x1}, {y1}),({x2},{y2})<|box_end|> {objects}"
    return objects


@settings(max_examples=200, deadline=None)
@given(text=answer_texts())
def test_rewriting_changes_only_the_coordinates(text):
    """The same coordinates written back give the text byte for byte (spacing, other numbers, escapes, key order);
    new coordinates change exactly the coordinate numbers (was: the whole JSON re-encoded, 0.90 -> 0.9)."""
    parsed = parse_answer(text)
    assert parsed.rewrite(lambda item: item.coords) == text
    moved = parsed.rewrite(lambda item: [v + 1000 for v in item.coords])
    assert [item.coords for item in parse_items(moved)] == [tuple(v + 1000 for v in i.coords) for i in parsed.items]
    assert re.sub(r"\d+", "N", moved) == re.sub(r"\d+", "N", text)


# --- item 2: every turn ---------------------------------------------------------------------------------------------

def agent_record(box: list[int]) -> dict:
    """An agent conversation with a box in the system prompt, the function call and the tool's result."""
    return {"messages": [
        {"role": "system", "content": f'Answer about the region {json.dumps({"bbox_2d": box})}.'},
        {"role": "user", "content": "<image>What is in the region?"},
        {"role": "function_call", "content": json.dumps({"name": "crop", "arguments": {"bbox_2d": box}})},
        {"role": "observation", "content": json.dumps({"objects": [{"bbox_2d": box, "label": "cat"}]})},
        {"role": "assistant", "content": json.dumps([{"bbox_2d": box, "label": "cat"}])}],
        "images": ["photo.jpg"], "tools": '[{"name": "crop", "parameters": {"type": "object"}}]'}


def write_yaml(tmp_path: Path, data_dir: Path, dataset: str = "train") -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(f"qwenvl_patch: true\nimage_min_pixels: {MIN}\nimage_max_pixels: {MAX}\ntemplate: qwen2_vl\n"
                    f"dataset_dir: {data_dir}\ndataset: {dataset}\n")
    return path


def test_system_and_tool_turns_are_converted_and_check_agrees(tmp_path, photo, capsys, tiny_model):
    """Was: boxes in system, function_call and observation turns stayed in original pixels, LF dropped the tool
    turns (the registry entry mapped no observation or function tags) and the tools, and `check` said OK."""
    box = [200, 100, 1800, 900]
    code, out, errors = convert(tmp_path, [agent_record(box)], "--input-coords", "abs")
    assert code == 0, errors
    [record] = records(out)
    for turn in record["messages"]:
        expected = [] if turn["role"] == "user" else [model_box(box)]
        assert [list(item.coords) for item in parse_items(turn["content"])] == expected, turn
    capsys.readouterr()
    assert main(["check", "--yaml", str(write_yaml(tmp_path, out.parent)), "--json"]) == 0
    _, _, dataset = lf_sft_dataset(tiny_model, out.parent, tmp_path / "lf", dataset="train",
                                   image_min_pixels=MIN, image_max_pixels=MAX)
    assert len(dataset) == 1  # LF kept the record, tools included
    observation = record["messages"][3]["content"]
    record["messages"][3]["content"] = observation.replace(json.dumps(model_box(box)), json.dumps(box))
    out.write_text(json.dumps(record) + "\n")  # a tool result left in original pixels, outside the model frame
    capsys.readouterr()
    assert main(["check", "--yaml", str(write_yaml(tmp_path, out.parent)), "--json"]) == 1
    [report] = json.loads(capsys.readouterr().out)
    assert [row["sample"] for row in report["problems"]] == [0] and "outside" in report["problems"][0]["error"]


# --- item 3: deep nesting -------------------------------------------------------------------------------------------

def test_deep_nesting_is_one_error_row_or_one_parse_failure(tmp_path, photo, capsys):
    """Was: RecursionError aborted convert, check, draw and eval (nothing written, even with --skip-bad), and the
    rewards raised on such a completion."""
    from llamafactory_qwenvl_patch.grpo.rewards.agent import AGENT_REWARDS
    from llamafactory_qwenvl_patch.grpo.rewards.builtin import BUILTIN

    good = {"image": "photo.jpg", "question": "Find it.", "answer": '[{"bbox_2d": [10, 20, 300, 400]}]'}
    lines = [good, {**good, "answer": DEEP}, {**good, "question": "Find " + DEEP},
             {**good, "answer": '{"a": ' + DEEP + "}"}, '{"image": "photo.jpg", "meta": ' + DEEP + "}"]
    code, out, errors = convert(tmp_path, lines, "--input-coords", "abs", "--skip-bad")
    assert code == 0 and len(records(out)) == 1
    assert set(errors) == {1, 2, 3, 4} and all("nested more than 100 levels" in e for e in errors.values())
    [record] = records(out)
    deep_rows = [{**record, "messages": [record["messages"][0], {"role": "assistant", "content": DEEP}]},
                 {**record, "messages": [{"role": "user", "content": "<image>" + DEEP}, record["messages"][1]]}]
    out.write_text("".join(json.dumps(r) + "\n" for r in [record, *deep_rows]))
    capsys.readouterr()
    assert main(["check", "--yaml", str(write_yaml(tmp_path, out.parent)), "--json"]) == 1
    [report] = json.loads(capsys.readouterr().out)
    assert [row["sample"] for row in report["problems"]] == [1, 2]
    out.write_text(json.dumps(record) + "\n")
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text(json.dumps({"predict": DEEP, "label": record["messages"][1]["content"]}) + "\n")
    assert main(["eval", str(out), "--predictions", str(predictions), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"]["parse_failure_rate"] == 1.0
    assert main(["draw", str(out), "-o", str(tmp_path / "drawn"), "--predictions", str(predictions)]) == 0
    for name, reward in BUILTIN.items():
        extra = {"trajectories": [{"turns": [], "end": "turns"}] * 2} if name in AGENT_REWARDS else {}
        for reference in (record["messages"][1]["content"], '{"total": "3"}'):
            assert len(reward([DEEP, "{" + '"a":' * 300 + "1" + "}" * 300], references=[reference] * 2,
                              prompts=["Q"] * 2, **extra)) == 2, name


# --- item 5: what LF loads -----------------------------------------------------------------------------------------

def test_what_convert_writes_lf_loads_and_what_it_cannot_carry_is_an_error_row(tmp_path, photo, capsys, tiny_model):
    """Was: records that start with an assistant turn or end with a user turn (LF drops them), audio dropped while
    <audio> tags stayed (LF raises), <video> tags without videos, chosen / rejected / kto_tag dropped, image tags miscounted in plain JSONL and
    alpaca (two tags in a question, a tag in the answer), a non-string alpaca system."""
    box = '[{"bbox_2d": [10, 20, 300, 400]}]'
    user, answer = {"role": "user", "content": "<image>Find it."}, {"role": "assistant", "content": box}
    cases = {  # per input format: (records LF must load, {what the error row says: a refused record})
        "sharegpt": ([{"messages": [user, answer], "images": ["photo.jpg"], "system": "You locate things."},
                      agent_record([200, 100, 1800, 900])], {
            "starts with an assistant": {"messages": [answer, user, answer], "images": ["photo.jpg"]},
            "ends with a user": {"messages": [user, answer, {"role": "user", "content": "More?"}],
                                 "images": ["photo.jpg"]},
            "system turn only first": {"messages": [user, {"role": "system", "content": "S"}, answer],
                                       "images": ["photo.jpg"]},
            "'audios'": {"messages": [{"role": "user", "content": "<image><audio>Find it."}, answer],
                         "images": ["photo.jpg"], "audios": ["clip.wav"]},
            "0 video(s) but 1 <video> tag(s)": {"messages": [{"role": "user", "content": "<image><video>Find it."},
                                                             answer], "images": ["photo.jpg"]},
            "'chosen', 'rejected'": {"messages": [user], "chosen": answer, "rejected": answer, "images": ["photo.jpg"]},
            "'kto_tag'": {"messages": [user, answer], "kto_tag": True, "images": ["photo.jpg"]},
            "a 'system' field and a system turn": {"messages": [{"role": "system", "content": "S"}, user, answer],
                                                   "images": ["photo.jpg"], "system": "T"}}),
        "alpaca": ([{"instruction": "Find it.", "output": box, "images": ["photo.jpg"], "system": "S",
                     "history": [["<image>What is this?", "A photo."]]},
                    {"instruction": "Find it.", "input": "The cat.", "output": box, "images": ["photo.jpg"]}], {
            "'system' must be text, got list": {"instruction": "Find it.", "output": box, "images": ["photo.jpg"],
                                                "system": ["S"]},
            "1 image(s) but 2 <image> tag(s)": {"instruction": "Find it.", "output": box, "images": ["photo.jpg"],
                                                "history": [["<image>What?", "A."], ["<image>And?", "B."]]}}),
        "jsonl": ([{"image": "photo.jpg", "question": "Find it.", "answer": box}], {
            "1 image(s) but 2 <image> tag(s)": {"image": "photo.jpg", "question": "<image><image>Find it.",
                                                "answer": box},
            "an <image> tag in an assistant turn": {"image": "photo.jpg", "question": "Find it.",
                                                   "answer": "<image>" + box}}),
    }
    written = {}
    for fmt, (accepted, refused) in cases.items():
        capsys.readouterr()
        code, out, errors = convert(tmp_path, [*accepted, *refused.values()], "--input-coords", "abs", "--skip-bad",
                                    "--format", fmt, name=f"{fmt}.jsonl")
        assert code == 0
        assert sorted(errors) == list(range(len(accepted), len(accepted) + len(refused))), (fmt, errors)
        for (expected, _), index in zip(refused.items(), sorted(errors)):
            assert expected in errors[index], (fmt, expected, errors[index])
        written[fmt] = records(out)
        assert len(written[fmt]) == len(accepted)
    assert written["sharegpt"][0]["messages"][0] == {"role": "system", "content": "You locate things."}
    assert [m["content"].count("<image>") for m in written["alpaca"][0]["messages"]] == [0, 1, 0, 0, 0]
    assert written["alpaca"][1]["messages"][0]["content"] == "<image>Find it.\nThe cat."
    capsys.readouterr()
    data_dir = tmp_path / "data"
    assert main(["check", "--yaml", str(write_yaml(tmp_path, data_dir, "sharegpt,alpaca,jsonl")), "--json"]) == 0
    _, _, dataset = lf_sft_dataset(tiny_model, data_dir, tmp_path / "lf", dataset="sharegpt,alpaca,jsonl",
                                   image_min_pixels=MIN, image_max_pixels=MAX)
    assert len(dataset) == sum(len(accepted) for accepted, _ in cases.values())  # LF's own loader drops none


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{},: é\n', max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                       max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(items=st.lists(JSON_VALUES, max_size=5), indent=st.sampled_from([None, 1]), chunk=st.integers(1, 64))
def test_json_arrays_are_split_into_their_records_as_written(items, indent, chunk):
    """JSON arrays are read record by record as raw text (ijson rounded numbers and kept the last of two equal
    keys): whatever the strings hold (quotes, brackets, escapes) and wherever a read ends."""
    import io

    from qwenvl_prep.formats import json_array

    text = json.dumps(items, indent=indent, ensure_ascii=False)
    original, json_array.CHUNK = json_array.CHUNK, chunk
    try:
        raw = list(json_array.iter_array_items(io.BytesIO(text.encode())))
    finally:
        json_array.CHUNK = original
    assert [json.loads(item) for item in raw] == items
    with pytest.raises(json_array.ArraySyntaxError):
        list(json_array.iter_array_items(io.BytesIO(text.encode()[:-1] + b"x")))
