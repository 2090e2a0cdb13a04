"""Video grounding rewards and eval: span and track answers parsed as robustly as boxes, temporal IoU, the track
score, the span-hack monitors, the rewards through the reward loader (with docs/video-rewards.md's tables checked
value by value) and ``qwenvl-prep eval`` on a hand-converted video dataset."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from helpers import SHAREGPT_INFO, write_clip
from hypothesis import given, settings
from hypothesis import strategies as st
from qwenvl_prep.cli import main

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.stamp import STAMP_KEY, Stamp, run_stamp
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.grpo.rewards.registry import load_rewards, score
from llamafactory_qwenvl_patch.scoring.answers import AnswerError
from llamafactory_qwenvl_patch.scoring.temporal import (
    SpanMonitorTally,
    TrackBox,
    parse_spans,
    parse_track,
    reference_kind,
    score_track,
    span_hacks,
    span_score,
    tiou,
    track_tolerance,
    try_parse_spans,
    try_parse_track,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "video-rewards.md"
SPAN_REF = '{"span": [5, 12]}'
TRACK_REF = '[{"time": 0, "bbox_2d": [0, 0, 40, 40]}, {"time": 1, "bbox_2d": [20, 0, 60, 40]}]'


def rewards(names: str, completions: list[str], references: list[str], metas: list | None = None) -> dict:
    """Each named reward's values, through the run's loader and scorer."""
    columns = {"references": references, "metas": metas or [None] * len(completions)}
    shared = {"resize_policy": None, "coords": "model"}
    return {r.name: score(r, completions, columns, shared).values for r in load_rewards(names, None)}


@pytest.mark.parametrize("text", [
    '{"span": [2.5, 7]}',
    'The moment is ```json\n{"span": [2.5, 7]}\n``` in the clip.',
    'It happens here: {"span": [2.5, 7.0]}, when the door opens.',
    '{"answer": {"span": [2.5, 7]}}',
    json.dumps(json.dumps({"span": [2.5, 7]})),  # double-encoded
])
def test_spans_are_found_wherever_boxes_would_be(text):
    assert parse_spans(text) == [(2.5, 7.0)]
    assert reference_kind(text) == "span"


@pytest.mark.parametrize("text", [
    '{"span": [5]}', '{"span": [1, 2, 3]}', '{"span": ["1", "2"]}', '{"span": [1, NaN]}', '{"span": 4}',
    '```json\n{"span": [1, \n```', 'from "span": [1, 2] on', '{"span": [1, 2], "span": [3, 4]}',
])
def test_malformed_spans_are_parse_failures(text):
    with pytest.raises(AnswerError):
        parse_spans(text)
    assert try_parse_spans(text) is None


def test_prose_and_other_answers_hold_no_span():
    for text in ["from 5 to 12 seconds", "the span of the clip is 30 s", "[]", '[{"bbox_2d": [1, 2, 3, 4]}]',
                 '{"name": "x", "time": "12:30"}']:
        assert try_parse_spans(text) == [] and reference_kind(text) is None, text


def test_tracks_parse_and_reject_untimed_boxes():
    track = parse_track(f"Here:\n```json\n{TRACK_REF}\n```")
    assert track == [TrackBox(0.0, (0.0, 0.0, 40.0, 40.0)), TrackBox(1.0, (20.0, 0.0, 60.0, 40.0))]
    assert reference_kind(TRACK_REF) == "track"
    assert parse_track('[{"time": 0.5, "bbox_2d": [1, 2, 3, 4], "label": "dog"}]')[0].label == "dog"
    assert try_parse_track('[{"bbox_2d": [1, 2, 3, 4]}]') == []  # an image answer: no track
    for bad in ['[{"time": 0, "bbox_2d": [1, 2, 3, 4]}, {"bbox_2d": [1, 2, 3, 4]}]', '[{"time": 0}]',
                '[{"time": 0, "bbox_2d": [1, 2, 3]}]', '[{"time": "0", "bbox_2d": [1, 2, 3, 4]}]']:
        assert try_parse_track(bad) is None, bad


def test_tiou_known_values():
    assert tiou((0, 10), (5, 15)) == pytest.approx(5 / 15)
    assert tiou((5, 12), (5, 12)) == 1.0
    assert tiou((0, 5), (5, 10)) == 0.0
    assert tiou((12, 5), (5, 12)) == 0.0  # inverted: never swapped
    assert tiou((8, 8), (5, 12)) == 0.0  # empty
    assert span_score([(5, 12)], [(5, 12), (0, 5)]) == 0.5  # an extra span halves the credit
    assert span_score([(0, 2), (4, 6)], [(4, 6), (0, 2)]) == 1.0  # one-to-one, order-free


@settings(max_examples=200, deadline=None)
@given(st.tuples(st.floats(-50, 50), st.floats(-50, 50)), st.tuples(st.floats(-50, 50), st.floats(-50, 50)))
def test_tiou_is_bounded_and_symmetric(a, b):
    value = tiou(a, b)
    assert 0.0 <= value <= 1.0 and value == pytest.approx(tiou(b, a))
    if a[1] > a[0]:
        assert tiou(a, a) == 1.0


def boxes(*entries: tuple[float, tuple[float, ...]]) -> list[TrackBox]:
    return [TrackBox(float(t), tuple(float(v) for v in box)) for t, box in entries]


def test_track_score_tolerance_missing_and_extra():
    truth = boxes((0, (0, 0, 10, 10)), (0.5, (0, 0, 10, 10)), (1.0, (0, 0, 10, 10)))
    assert track_tolerance(truth) == 0.25 and track_tolerance(truth[:1]) == 0.5
    assert score_track(truth, truth).score == 1.0
    assert score_track(truth, truth[:1]).ious == (1.0, 0.0, 0.0)  # missing times count 0
    late = boxes((0.3, (0, 0, 10, 10)))
    assert score_track(truth[:1], late).score == 1.0 and score_track(truth, late).ious == (0.0, 1.0, 0.0)
    # answered at Qwen3's group stamps (each pair of frames' mean time): every truth frame is within reach
    stamps = boxes((0.25, (0, 0, 10, 10)), (0.75, (0, 0, 10, 10)))
    assert score_track(truth, stamps).score == 1.0
    # outside the truth's range: extra; between sparse truth times: not extra
    assert score_track(truth, truth + boxes((3, (0, 0, 10, 10)))).extra == 1
    sparse = boxes((0, (0, 0, 10, 10)), (2, (0, 0, 10, 10)))
    assert score_track(sparse, sparse + boxes((1, (50, 50, 60, 60)))).score == 1.0
    assert score_track(truth, []).score == 0.0 and score_track([], truth).score == 0.0


def test_hedging_at_one_time_buys_nothing():
    truth = boxes((0, (0, 0, 10, 10)))
    hedged = boxes((0, (50, 50, 60, 60)), (0, (0, 0, 10, 10)))
    assert score_track(truth, hedged).score == 0.0
    near = boxes((0.01, (50, 50, 60, 60)), (0.02, (0, 0, 10, 10)))  # the nearest time's box, not the best box
    assert score_track(truth, near).score == 0.0


@settings(max_examples=50, deadline=None)
@given(st.floats(0.2, 5), st.floats(0.2, 5))
def test_track_score_is_the_same_in_any_scaled_frame(sx, sy):
    """Why eval compares track boxes in the dataset's frame: the score does not change when both axes scale."""
    truth = boxes((0, (10, 10, 50, 50)), (1, (20, 10, 60, 50)))
    predicted = boxes((0, (12, 8, 45, 52)), (1.1, (30, 10, 70, 40)))

    def scaled(track):
        return [TrackBox(e.time, (e.box[0] * sx, e.box[1] * sy, e.box[2] * sx, e.box[3] * sy)) for e in track]

    assert score_track(scaled(truth), scaled(predicted)).score == pytest.approx(score_track(truth, predicted).score)


def test_span_hacks_and_monitors():
    truth = [(5.0, 12.0)]
    assert span_hacks(truth, [(0, 30)], 30) == ["whole_clip"]
    assert span_hacks(truth, [(0, 30)], None) == []  # the clip's length unknown: not judged
    assert span_hacks([(0, 28)], [(0, 30)], 30) == []  # a long truth moment: most of the clip is honest
    assert span_hacks(truth, [(12, 5)], 30) == ["degenerate"]
    assert span_hacks(truth, [(20, 31)], 30) == ["beyond_clip"]
    assert span_hacks(truth, [(-1, 3)], None) == ["beyond_clip"]  # before 0 needs no duration
    assert span_hacks(truth, [(20, 30.4)], 30) == []  # within 0.5 s of the end: rounding, not a hack
    assert span_hacks(truth, [(5, 12), (1, 2)], 30) == ["many_spans"]
    first, second = SpanMonitorTally(), SpanMonitorTally()
    first.add(truth, [(0, 30)], 30)
    first.add(truth, None, 30)
    second.add(truth, [(5, 19)], 30)
    second.add(truth, [(12, 5)], 30)
    first.merge(second)
    rates = first.to_dict()
    assert rates["span_whole_clip_rate"] == 0.25 and rates["span_degenerate_rate"] == 0.25
    assert rates["span_empty_answer_rate"] == 0.25 and rates["span_many_spans_rate"] == 0.0
    assert rates["span_length_ratio_median"] == 2.0  # 30/7, 14/7, 0 (inverted)
    assert SpanMonitorTally().to_dict()["span_whole_clip_rate"] is None


def doc_table(header: str) -> list[list[str]]:
    """The rows of the docs table whose header starts with ``header``, cells stripped of backticks."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([re.sub(r"^`(.*)`$", r"\1", cell.strip()) for cell in line.strip("|").split(" | ")])
    return rows


def test_the_docs_span_table_is_what_the_rewards_return():
    rows = doc_table("| answer | what it is | `tiou`")
    answers = [row[0] for row in rows]
    got = rewards("tiou,span_sanity,format", answers, [SPAN_REF] * len(rows), [{"duration": 30}] * len(rows))
    assert len(rows) == 9
    for i, row in enumerate(rows):
        expected = [float(v) for v in row[2:]]
        assert [got["tiou"][i], got["span_sanity"][i], got["format"][i]] == pytest.approx(expected, abs=5e-4), row


def test_the_docs_track_table_is_what_the_rewards_return():
    rows = doc_table("| answer | what it is | `track`")
    got = rewards("track,format", [row[0] for row in rows], [TRACK_REF] * len(rows))
    assert len(rows) == 8
    for i, row in enumerate(rows):
        assert [got["track"][i], got["format"][i]] == pytest.approx([float(row[2]), float(row[3])], abs=5e-4), row


def test_the_docs_yaml_loads_and_rewards_of_another_kind_score_zero():
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)
    keys = yaml.safe_load(block)
    loaded = load_rewards(keys["reward_funcs"], str(keys["reward_weights"]))
    assert [(r.name, r.weight) for r in loaded] == [("tiou", 1.0), ("span_sanity", 1.0), ("format", 0.2)]
    image_ref, field_ref = '[{"bbox_2d": [0, 0, 10, 10]}]', '{"name": "Ada"}'
    got = rewards("tiou,track,span_sanity", [image_ref, field_ref, SPAN_REF], [image_ref, field_ref, TRACK_REF])
    assert got == {"tiou": [0.0] * 3, "track": [0.0] * 3, "span_sanity": [0.0] * 3}
    # the image format rule still applies to image records; a track answer is no image answer's format
    assert rewards("format", [image_ref, TRACK_REF], [image_ref, image_ref])["format"] == [1.0, 1.0]
    assert rewards("format", [image_ref], [TRACK_REF])["format"] == [0.0]
    # an empty track (the target is not in the video): only [] answers it, as under iou
    assert rewards("track,format", ["[]", TRACK_REF, "nothing"], ["[]"] * 3)["track"] == [1.0, 0.0, 0.0]
    # ... on a video prompt only: an image's "not present" abstention is iou's to pay, not paid twice
    from llamafactory_qwenvl_patch.grpo.rewards.video import track_reward

    assert track_reward(["[]", "[]"], references=["[]", "[]"], prompts=["<|vision_start|><|image_pad|>Find it",
                                                                         "<|video_pad|><|video_pad|>Track it"]) == [0.0,
                                                                                                                   1.0]
    beside = f'{TRACK_REF}\nAlso here: {{"bbox_2d": [1, 1, 5, 5]}}'  # an untimed box in a JSON value of its own
    assert rewards("format,track", [beside], [TRACK_REF]) == {"format": [0.0], "track": [1.0]}


def write_video_dataset(folder: Path, records: list[dict], stamp: Stamp, predictions: list[dict]) -> list[str]:
    """A dataset converted by hand (LF sharegpt with a videos column, stamped) and its predictions: eval's
    arguments."""
    columns = {**SHAREGPT_INFO["columns"], "videos": "videos"}
    info = {"video": {"file_name": "video.json", **SHAREGPT_INFO, "columns": columns, STAMP_KEY: stamp.to_dict()}}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    (folder / "video.json").write_text(json.dumps(records))
    (folder / "preds.jsonl").write_text("".join(json.dumps(p) + "\n" for p in predictions))
    return ["eval", str(folder / "video.json"), "--predictions", str(folder / "preds.jsonl")]


def test_eval_on_a_hand_converted_video_dataset(tmp_path, capsys):
    """Span records get R@1 at tIoU 0.3/0.5/0.7, mean tIoU and the monitors; track records per-frame Acc@0.5 and
    mean IoU in the clip's pixels (its size probed from the file, its frame from the stamp's video policy); both
    per subset with --by, in the JSON and the table."""
    clip = write_clip(tmp_path / "clip.mp4", 30, 1, 64, 48)  # 30 s, as meta.duration says
    video = VideoPolicy(16 * 28 * 28, 64 * 28 * 28)
    stamp = run_stamp(ResizePolicy(16 * 28 * 28, 64 * 28 * 28), "qwen2_5_vl", video)
    records, predictions = [], []
    spans = [('{"span": [4, 10]}', '{"span": [4, 10]}', "a"), ('{"span": [4, 10]}', 'It is {"span": [6, 10]}.', "a"),
             ('{"span": [3, 9]}', '{"span": [0, 30]}', "b")]  # tIoU 1, 4/6, 6/30 (the whole clip)
    for reference, answer, source in spans:
        records.append({"messages": [{"role": "user", "content": "<video>When does the door open?"},
                                     {"role": "assistant", "content": reference}],
                        "videos": [clip.name], "meta": {"source": source, "duration": 30}})
        predictions.append({"predict": answer, "label": reference})
    height, width = video.frame_size(48, 64)  # the clip's frame: track boxes are written in it
    tracks = [  # a box that stays put while the object moves right (IoU 1, then 1/3)
        ('[{"time": 0, "bbox_2d": [0, 0, 20, 20]}, {"time": 1, "bbox_2d": [10, 0, 30, 20]}]',
         '[{"time": 0, "bbox_2d": [0, 0, 20, 20]}, {"time": 1, "bbox_2d": [0, 0, 20, 20]}]', "a"),
        # a box reaching past the frame's right edge: clamped to the clip's pixels it is the truth (IoU 1, not 1/2)
        (json.dumps([{"time": 0.5, "bbox_2d": [0, 0, width, height // 2]}]),
         json.dumps([{"time": 0.5, "bbox_2d": [0, 0, 2 * width, height // 2]}]), "b")]
    tracks.append(("[]", "[]", "b"))  # an empty track: the target is not in the video, and the model says so
    for reference, answer, source in tracks:
        records.append({"messages": [{"role": "user", "content": "<video>Track the bar."},
                                     {"role": "assistant", "content": reference}],
                        "videos": [clip.name], "meta": {"source": source}})
        predictions.append({"predict": answer, "label": reference})
    command = write_video_dataset(tmp_path, records, stamp, predictions)
    capsys.readouterr()
    assert main([*command, "--json", "--by", "source"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["spans"] == {"samples": 3, "r1@0.3": pytest.approx(2 / 3, abs=1e-4),
                               "r1@0.5": pytest.approx(2 / 3, abs=1e-4), "r1@0.7": pytest.approx(1 / 3, abs=1e-4),
                               "mean_tiou": pytest.approx((1 + 4 / 6 + 0.2) / 3, abs=1e-4), "parse_failure_rate": 0.0}
    assert result["span_monitors"]["span_whole_clip_rate"] == pytest.approx(1 / 3)
    assert result["tracks"] == {"samples": 2, "frames": 3, "acc@0.5": pytest.approx(2 / 3, abs=1e-4),
                                "mean_iou": pytest.approx(7 / 9, abs=1e-4),
                                "mean_track_score": pytest.approx(5 / 6, abs=1e-4), "parse_failure_rate": 0.0}
    assert result["video_not_present"]["samples"] == 1 and result["video_not_present"]["said_nothing_rate"] == 1.0
    assert set(result["by"]) == {"source=a", "source=b"}
    assert result["by"]["source=a"]["spans"]["samples"] == 2 and result["by"]["source=a"]["tracks"]["frames"] == 2
    assert result["by"]["source=b"]["spans"]["mean_tiou"] == 0.2 and result["by"]["source=b"]["tracks"]["frames"] == 1
    assert "overall" not in result and "fields" not in result and result["skipped_other"] == 0
    assert main([*command, "--by", "source"]) == 0
    table = capsys.readouterr().out
    assert "temporal spans" in table and "box tracks" in table and "source=b" in table and "whole clip 0.333" in table
    assert "not in the video (empty track []): 1 records; answered [] 1.000" in table


def test_eval_needs_the_video_frame_of_a_track(tmp_path, capsys):
    """A track's boxes are in the video frame: a dataset stamped without a video policy cannot place them."""
    write_clip(tmp_path / "clip.mp4", 1, 4, 64, 48)
    reference = '[{"time": 0, "bbox_2d": [0, 0, 20, 20]}]'
    record = {"messages": [{"role": "user", "content": "<video>Track the bar."},
                           {"role": "assistant", "content": reference}], "videos": ["clip.mp4"]}
    stamp = run_stamp(ResizePolicy(16 * 28 * 28, 64 * 28 * 28), "qwen2_5_vl")
    assert main(write_video_dataset(tmp_path, [record], stamp, [{"predict": reference}])) != 0
    assert "no video policy" in capsys.readouterr().err


def test_grpo_eval_scores_video_records_as_video():
    """GRPO's evaluation sends span and track records to the video metrics (a track is not an image's boxes, a span
    not a field), as qwenvl-prep eval does."""
    from llamafactory_qwenvl_patch.grpo.rewards.evaluation import eval_metrics
    from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta

    prompt = "<|vision_start|><|video_pad|><|video_pad|><|vision_end|>When?"
    meta = [SampleMeta(0, prompt, SPAN_REF, (90, 160), (84, 168), meta={"duration": 10.0}),
            SampleMeta(1, prompt, TRACK_REF, (90, 160), (84, 168))]
    swapped = json.dumps([dict(box, time=float(1 - i)) for i, box in
                          enumerate(json.loads(TRACK_REF))])
    metrics = eval_metrics(meta, [SPAN_REF, swapped], [], None, "model", "eval")
    assert metrics["eval_spans/r1@0.5"] == 1.0 and metrics["eval_spans/mean_tiou"] == 1.0
    assert metrics["eval_tracks/acc@0.5"] == 0.0 and metrics["eval_tracks/mean_track_score"] < 0.5  # swapped in time
    assert not any(k.startswith(("eval_fields/", "eval_acc@")) for k in metrics)
