"""Click and detection rewards (click, click_dense, det_f1, box_sanity) and the detection monitors: computed in each
sample's model frame for every family, with property tests (bounds, order invariance, never above a perfect
answer)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.grpo.rewards.builtin import BUILTIN
from llamafactory_qwenvl_patch.scoring.clicks import click_dense_score, click_hit, click_point
from llamafactory_qwenvl_patch.scoring.detection import (
    Detection,
    MonitorTally,
    detection_f1,
    hacks,
    match_detections,
)

SCREEN_SIZES = [(1080, 1920), (2532, 1170), (1440, 2560), (800, 1280)]  # (height, width)


def _family_frame(name: str, orig_hw: tuple[int, int]):
    family = FAMILIES[name]
    policy = ResizePolicy(256 * 28 * 28, 1024 * 28 * 28, family.factor)
    return family.coords, policy.model_size(*orig_hw)


def _rewards(name, completions, references, metas, orig_hw, model_hw, coords):
    n = len(completions)
    return BUILTIN[name](completions, references=references, metas=metas, orig_sizes=[orig_hw] * n,
                         model_sizes=[model_hw] * n, coords=coords)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("orig_hw", SCREEN_SIZES)
def test_click_in_each_family_frame(family, orig_hw):
    """The truth box comes in original pixels (meta.bbox_orig); a click at its centre in the family's frame hits,
    the same numbers read as original pixels (the peers' mistake) miss when the frames differ."""
    coords, model_hw = _family_frame(family, orig_hw)
    height, width = orig_hw
    box = [width * 0.70, height * 0.10, width * 0.74, height * 0.13]  # a small button near the top right
    centre = [(box[0] + box[2]) / 2, (box[1] + box[3]) / 2]
    in_frame = convert_coords(centre, "orig", coords, orig_hw, model_hw)
    reference = json.dumps([{"point_2d": in_frame}])
    answers = [json.dumps([{"point_2d": in_frame}]), json.dumps([{"point_2d": [round(v) for v in centre]}]),
               json.dumps(in_frame)]
    metas = [{"bbox_orig": box}] * 3
    assert _rewards("click", answers, [reference] * 3, metas, orig_hw, model_hw, coords) == [1.0, 0.0, 1.0]
    dense = _rewards("click_dense", answers, [reference] * 3, metas, orig_hw, model_hw, coords)
    assert dense[0] == dense[2] == 1.0 and dense[1] < 0.01


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_click_falls_back_to_the_reference_box(family):
    coords, model_hw = _family_frame(family, (1080, 1920))
    reference = json.dumps([{"bbox_2d": [100, 50, 140, 80], "label": "OK"}])
    answers = ['[{"point_2d": [120, 60]}]', '[{"bbox_2d": [110, 55, 130, 75]}]', '[{"point_2d": [300, 60]}]',
               '[{"point_2d": [120, 60]}, {"point_2d": [900, 900]}]', '[{"point_2d": [900, 900]}, {"point_2d": [120, 60]}]']
    assert _rewards("click", answers, [reference] * 5, None, (1080, 1920), model_hw, coords) == [1, 1, 0, 1, 0]


def test_click_without_a_truth_box_scores_zero():
    """A point-only reference and no meta box: nothing to land in, so no reward (never a crash)."""
    assert BUILTIN["click"](['[{"point_2d": [1, 1]}]'], references=['[{"point_2d": [1, 1]}]']) == [0.0]


def test_click_point_forms():
    assert click_point('[{"point_2d": [3, 4]}]') == (3, 4)
    assert click_point('{"bbox_2d": [0, 0, 10, 20]}') == (5, 10)
    assert click_point("(7, 8)") == (7, 8)
    assert click_point("```\n[7, 8]\n```") == (7, 8)
    assert click_point("I would click [7, 8] maybe") is None
    assert click_point('[{"point_2d": [3]}]') is None
    assert click_point("") is None


def test_click_dense_formula():
    box = [100, 100, 140, 120]  # 40 x 20
    assert click_dense_score((100, 120), box) == 1.0
    assert click_dense_score((160, 110), box) == pytest.approx(math.exp(-0.5))  # half a width to the right
    assert click_dense_score((120, 130), box) == pytest.approx(math.exp(-0.5))  # half a height below
    assert click_dense_score((180, 110), box) == pytest.approx(math.exp(-2))


COORD = st.floats(0, 1000, allow_nan=False)


@st.composite
def boxes(draw):
    x1, x2 = sorted((draw(COORD), draw(COORD)))
    y1, y2 = sorted((draw(COORD), draw(COORD)))
    return [round(x1), round(y1), round(x2) + 1, round(y2) + 1]


@settings(max_examples=200, deadline=None)
@given(box=boxes(), x=COORD, y=COORD)
def test_click_properties(box, x, y):
    """click and click_dense lie in [0, 1]; click_dense is 1 wherever click is (never below it) and falls with the
    distance outside the box."""
    hit, dense = click_hit((x, y), box), click_dense_score((x, y), box)
    assert 0.0 <= dense <= 1.0
    assert dense >= float(hit)
    if not hit:
        farther = (x + (box[2] - box[0]) if x > box[2] else x, y)
        assert click_dense_score(farther, box) <= dense


LABELS = st.sampled_from([None, "cat", "dog"])


@st.composite
def answers(draw):
    return [{"bbox_2d": draw(boxes()), **({"label": label} if (label := draw(LABELS)) else {})}
            for _ in range(draw(st.integers(0, 6)))]


@settings(max_examples=200, deadline=None)
@given(truth=answers(), answer=answers(), seed=st.randoms())
def test_det_f1_properties(truth, answer, seed):
    reference = json.dumps(truth)
    shuffled = list(answer)
    seed.shuffle(shuffled)
    values = BUILTIN["det_f1"]([json.dumps(answer), json.dumps(shuffled), reference], references=[reference] * 3)
    assert 0.0 <= values[0] <= 1.0
    assert values[0] == pytest.approx(values[1])  # the order of boxes in the answer does not matter
    assert values[2] == 1.0 >= values[0]  # the truth itself is perfect and nothing scores above it
    sanity = BUILTIN["box_sanity"]([json.dumps(answer), reference], references=[reference] * 2,
                                   orig_sizes=[(1000, 1000)] * 2, model_sizes=[(1000, 1000)] * 2, coords="rel1000")
    assert -1.0 <= sanity[0] <= 0.0
    assert sanity[1] == 0.0  # the truth itself is never a hack


def test_det_f1_by_hand():
    truth = [Detection((0, 0, 10, 10), "cat"), Detection((20, 20, 30, 30), "dog")]
    assert detection_f1(truth, [Detection((0, 0, 10, 10), "cat")]) == pytest.approx(2 / 3)
    assert detection_f1(truth, [Detection((0, 0, 10, 10), "dog")]) == 0.0  # right place, wrong label
    assert detection_f1(truth, [Detection((0, 0, 10, 10))]) == 0.0  # a labelled truth needs the label
    assert detection_f1([Detection((0, 0, 10, 10))], [Detection((0, 0, 10, 10), "cat")]) == 1.0  # class-agnostic
    assert detection_f1(truth, [Detection((1, 1, 11, 11), "Cat "), Detection((21, 20, 30, 30), "DOG")]) == 1.0
    assert detection_f1([], []) == 1.0 and detection_f1([], [Detection((0, 0, 1, 1))]) == 0.0
    # IoU 0.5 exactly counts; the matching prefers more matches over one better match
    assert match_detections([Detection((0, 0, 10, 10))], [Detection((0, 0, 10, 5))]) == [(0, 0, 0.5)]
    two = [Detection((0, 0, 10, 10)), Detection((0, 0, 10, 12))]
    assert len(match_detections(two, [Detection((0, 0, 10, 11)), Detection((0, 0, 10, 9))])) == 2
    assert BUILTIN["det_f1"](['[{"bbox_2d": [0, 0, 10]}]'], references=['[{"bbox_2d": [0, 0, 10, 10]}]']) == [0.0]
    # a "not present" reference: only an empty list answers it
    assert BUILTIN["det_f1"](["[]", "```json\n[]\n```", "", "nothing here", '[{"bbox_2d": [0, 0, 5, 5]}]'],
                             references=["[]"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_hacks_by_hand():
    truth = [Detection((10, 10, 20, 20))]
    frame = (100.0, 100.0)
    assert hacks(truth, [Detection((0, 0, 100, 95))], frame) == ["whole_image"]
    assert hacks([Detection((0, 0, 100, 90))], [Detection((0, 0, 100, 95))], frame) == []  # the truth is that big
    assert hacks(truth, [Detection((i, i, i + 5, i + 5)) for i in range(4)], frame) == []
    assert hacks(truth, [Detection((i, i, i + 5, i + 5)) for i in range(0, 50, 10)], frame) == ["too_many"]
    assert hacks(truth, [Detection((10, 10, 20, 20)), Detection((10, 10, 20, 20.5))], frame) == ["duplicates"]
    assert hacks(truth, [Detection((10, 10, 20, 20), "a"), Detection((10, 10, 20, 20), "b")], frame) == []
    crowded = [Detection((10, 10, 20, 20), "a"), Detection((10, 10, 20, 20.5), "a")]  # two real overlapping objects
    assert hacks(crowded, crowded, frame) == []
    assert hacks(crowded, crowded + [Detection((10, 10, 20.2, 20), "a")], frame) == ["duplicates"]
    assert BUILTIN["box_sanity"](['[{"bbox_2d": [0, 0, 1000, 1000]}, {"bbox_2d": [0, 0, 1000, 1000]}]'],
                                 references=['[{"bbox_2d": [10, 10, 20, 20]}]'], orig_sizes=[(50, 50)],
                                 model_sizes=[(56, 56)], coords="rel1000") == [pytest.approx(-2 / 3)]


def test_monitor_tally():
    tally = MonitorTally()
    truth = [Detection((10, 10, 20, 20)), Detection((30, 30, 40, 40))]
    tally.add(truth, [Detection((0, 0, 100, 100))], (100, 100))  # whole image
    tally.add(truth, [], (100, 100))  # empty
    tally.add(truth, None, (100, 100))  # malformed: no boxes
    tally.add(truth, [Detection((10, 10, 20, 20)), Detection((10, 10, 20, 20)), Detection((30, 30, 50, 50))],
              (100, 100))
    summary = tally.to_dict()
    assert summary["whole_image_rate"] == 0.25 and summary["empty_answer_rate"] == 0.5
    assert summary["duplicate_rate"] == 0.25
    assert summary["count_ratio"] == pytest.approx(4 / 8)
    assert summary["area_ratio_median"] == pytest.approx((100 + 200 / 100) / 2)
    assert MonitorTally().to_dict()["whole_image_rate"] is None


@st.composite
def family_frames(draw):
    """(coords, orig_hw, model_hw) of a real family and screen size: model pixels or 0-1000."""
    coords, model_hw = _family_frame(draw(st.sampled_from(sorted(FAMILIES))), orig_hw := draw(st.sampled_from(
        SCREEN_SIZES)))
    return coords, orig_hw, model_hw


@settings(max_examples=100, deadline=None)
@given(frame=family_frames(), truth=answers(), answer=answers(), seed=st.randoms())
def test_box_sanity_in_every_family_frame(frame, truth, answer, seed):
    """Boxes drawn in 0-1000 and scaled into the family's frame: box_sanity stays in [-1, 0], ignores the order of
    the boxes and never flags the truth."""
    coords, orig_hw, model_hw = frame
    width, height = (model_hw[1], model_hw[0]) if coords == "model" else (1000, 1000)

    def scaled(items):
        return json.dumps([{**item, "bbox_2d": [item["bbox_2d"][0] * width / 1001, item["bbox_2d"][1] * height / 1001,
                                                 item["bbox_2d"][2] * width / 1001, item["bbox_2d"][3] * height / 1001]}
                           for item in items])
    shuffled = list(answer)
    seed.shuffle(shuffled)
    reference = scaled(truth)
    values = BUILTIN["box_sanity"]([scaled(answer), scaled(shuffled), reference], references=[reference] * 3,
                                   orig_sizes=[orig_hw] * 3, model_sizes=[model_hw] * 3, coords=coords)
    assert -1.0 <= values[0] <= 0.0 and values[0] == values[1] and values[2] == 0.0


def test_coco_map_is_order_free_and_counts_every_box():
    from llamafactory_qwenvl_patch.scoring.coco_map import coco_map

    truth = [Detection((0, 0, 10, 10), "cat"), Detection((20, 20, 30, 30), "dog")]
    wrong = Detection((40, 40, 50, 50), "cat")
    images = [(truth, [wrong, *truth], (100, 100)), (truth[:1], truth[:1], (100, 100))]
    first = coco_map(images)
    reordered = coco_map([(t, list(reversed(p)), s) for t, p, s in images])  # box order
    order_free = ("map", "ap50", "ap75")
    assert [reordered[k] for k in order_free] == [first[k] for k in order_free]
    assert [coco_map(list(reversed(images)))[k] for k in order_free] == [first[k] for k in order_free]
    assert reordered["pycocotools_map"] != first["pycocotools_map"]  # why `map` is not pycocotools' ranking AP
    # cat: 2 of 3 predictions right, both truths found (AP 2/3); dog: 1 of 1 (AP 1)
    assert first["map"] == pytest.approx((2 / 3 + 1) / 2, abs=1e-4)
    many = [Detection((i * 3, 0, i * 3 + 2, 2)) for i in range(120)]  # 120 boxes in one image, all right
    result = coco_map([(many, many, (400, 10))])
    assert result["map"] == 1.0 and result["pycocotools_map"] == 1.0


def test_monitors_in_a_non_square_model_frame():
    from llamafactory_qwenvl_patch.grpo.rewards.monitors import add_monitors
    from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta
    from llamafactory_qwenvl_patch.scoring.temporal import SpanMonitorTally

    meta = [SampleMeta(0, "p", '[{"bbox_2d": [10, 10, 40, 30]}]', (1080, 1920), (336, 588))]
    tally, spans = MonitorTally(), SpanMonitorTally()
    add_monitors(tally, spans, ['[{"bbox_2d": [0, 0, 588, 336]}]', '[{"bbox_2d": [0, 0, 336, 336]}]'], meta, 2,
                 "model")
    assert tally.to_dict()["whole_image_rate"] == 0.5  # 588 x 336 covers the frame; 336 x 336 does not
    other = MonitorTally()
    add_monitors(other, spans, ["[]", "[]"], meta, 2, "model")
    tally.merge(other)
    assert tally.to_dict()["empty_answer_rate"] == 0.5 and tally.answers == 4 and spans.answers == 0


def test_video_prompts_feed_the_span_monitors_and_not_the_box_ones():
    """A span reference counts its completions' span hacks (the whole clip here); a box track is no many-box
    answer, so neither tally counts it."""
    from llamafactory_qwenvl_patch.grpo.rewards.monitors import add_monitors
    from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta
    from llamafactory_qwenvl_patch.scoring.temporal import SpanMonitorTally

    meta = [SampleMeta(0, "p", '{"span": [2.0, 4.0]}', (90, 160), (84, 168), meta={"duration": 10.0}),
            SampleMeta(1, "p", '[{"time": 1.0, "bbox_2d": [1, 2, 30, 40]}]', (90, 160), (84, 168))]
    tally, spans = MonitorTally(), SpanMonitorTally()
    texts = ['{"span": [0.0, 10.0]}', '{"span": [2.0, 4.5]}', '[{"bbox_2d": [0, 0, 168, 84]}]', "[]"]
    add_monitors(tally, spans, texts, meta, 2, "model")
    assert spans.answers == 2 and spans.to_dict()["span_whole_clip_rate"] == 0.5
    assert tally.answers == 0


def _reference_matches(truth, predicted, threshold):
    """The matching as it was computed box by box (before the IoU matrix): the reference of the vectorised one."""
    from scipy.optimize import linear_sum_assignment

    from llamafactory_qwenvl_patch.scoring.detection import label_key
    from llamafactory_qwenvl_patch.scoring.metrics import iou

    if not truth or not predicted:
        return []
    weights = [[(1.0 + iou(t.box, p.box)) if iou(t.box, p.box) >= threshold and (
        t.label is None or label_key(t.label) == label_key(p.label)) else 0.0 for p in predicted] for t in truth]
    rows, cols = linear_sum_assignment(weights, maximize=True)
    return [(int(r), int(c), weights[r][c] - 1.0) for r, c in zip(rows, cols) if weights[r][c] > 0]


_COORD = st.integers(-5, 60).map(float)
_BOXES = st.lists(st.tuples(_COORD, _COORD, _COORD, _COORD), max_size=12)
_LABELS = st.sampled_from([None, "cat", "Cat ", "dog", ""])


@settings(max_examples=150, deadline=None)
@given(_BOXES, _BOXES, st.lists(_LABELS, min_size=12, max_size=12), st.lists(_LABELS, min_size=12, max_size=12),
       st.sampled_from([0.5, 0.75, 0.95]))
def test_the_iou_matrix_and_vectorised_matching_equal_the_box_by_box_ones(truth, predicted, truth_labels,
                                                                         predicted_labels, threshold):
    """Issue 33, class 9: the IoU matrix is computed in numpy; every entry equals ``iou`` exactly (degenerate and
    inverted boxes included) and the matches equal the box-by-box computation's."""
    from llamafactory_qwenvl_patch.scoring.detection import Detection, match_detections
    from llamafactory_qwenvl_patch.scoring.metrics import iou, iou_matrix

    matrix = iou_matrix(truth, predicted)
    assert matrix.shape == (len(truth), len(predicted))
    assert all(matrix[i, j] == iou(t, p) for i, t in enumerate(truth) for j, p in enumerate(predicted))
    true = [Detection(box, label) for box, label in zip(truth, truth_labels)]
    guesses = [Detection(box, label) for box, label in zip(predicted, predicted_labels)]
    ours, reference = match_detections(true, guesses, threshold), _reference_matches(true, guesses, threshold)
    assert [pair[:2] for pair in ours] == [pair[:2] for pair in reference]
    # the IoU itself now, where it was (1 + IoU) - 1 (off by one rounding step)
    assert all(abs(a[2] - b[2]) <= 1e-12 and a[2] == iou(true[a[0]].box, guesses[a[1]].box)
               for a, b in zip(ours, reference))


def test_duplicate_pairs_by_blocks_equal_the_pairwise_count():
    import random

    from llamafactory_qwenvl_patch.scoring import detection
    from llamafactory_qwenvl_patch.scoring.metrics import iou

    rng = random.Random(0)
    boxes = []
    for _ in range(300):
        x, y = rng.uniform(0, 900), rng.uniform(0, 900)
        boxes.append(detection.Detection((x, y, x + 50, y + 40), rng.choice(["a", "b", None])))
        if rng.random() < 0.3:  # a near copy: a duplicate pair
            boxes.append(detection.Detection((x + 1, y, x + 51, y + 40), boxes[-1].label))
    expected = sum(detection.label_key(a.label) == detection.label_key(b.label) and iou(a.box, b.box) >= 0.9
                   for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert expected > 50
    saved = detection.DUPLICATE_BLOCK
    try:
        detection.DUPLICATE_BLOCK = 7  # many blocks, uneven last one
        assert detection._duplicate_pairs(boxes) == expected
    finally:
        detection.DUPLICATE_BLOCK = saved
    assert detection._duplicate_pairs(boxes) == expected


def test_referring_expression_accuracy_takes_the_first_box_only():
    """RefCOCO is published as the accuracy of the one box answered; Acc@0.5 matches every answered box one to
    one, so an answer listing a wrong box and then the right one scores there but not as a referring expression."""
    from llamafactory_qwenvl_patch.scoring.answers import parse_items
    from llamafactory_qwenvl_patch.scoring.grounding_eval import GroundingEval

    truth = [10, 10, 110, 60]
    reference = parse_items(json.dumps([{"bbox_2d": truth}]))
    meta = {"bbox_orig": truth}
    tally = GroundingEval()
    for answer in ([{"bbox_2d": [300, 300, 400, 400]}, {"bbox_2d": [12, 10, 110, 62]}],  # right box second
                   [{"bbox_2d": [12, 10, 110, 62]}],  # right box first
                   [{"point_2d": [50, 30]}]):  # a point: a click, no box
        tally.add(reference, json.dumps(answer), meta, list, (640, 480))
    result = tally.to_dict()
    assert result["boxes"]["acc@0.5"] == round(2 / 3, 4)  # rates are printed to 4 places
    assert result["clicks"]["first_box_samples"] == 3
    assert result["clicks"]["first_box_acc@0.5"] == round(1 / 3, 4)
    assert result["clicks"]["click_acc"] == round(2 / 3, 4)  # the first box's centre, the point
    points_only = GroundingEval()
    points_only.add(parse_items(json.dumps([{"point_2d": [60, 35]}])), json.dumps([{"point_2d": [60, 35]}]), meta,
                    list, (640, 480))
    assert "first_box_acc@0.5" not in points_only.to_dict()["clicks"]  # ScreenSpot's point labels: no such rate
