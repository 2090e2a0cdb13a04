"""``qwenvl-prep eval``: predictions against a converted dataset, with every metric in original-image pixels.

Predictions are LLaMA-Factory's ``generated_predictions.jsonl`` (``do_predict`` + ``predict_with_generate``), joined
to the dataset by order and checked label by label, or the output of ``qwenvl-prep predict``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Sequence

from llamafactory_qwenvl_patch.scoring.answers import not_present
from llamafactory_qwenvl_patch.scoring.fields import reference_value, score_fields
from llamafactory_qwenvl_patch.scoring.grounding_eval import GroundingEval, is_grounding
from llamafactory_qwenvl_patch.scoring.metrics import IOU_THRESHOLD, FieldTally
from llamafactory_qwenvl_patch.scoring.temporal import reference_kind
from llamafactory_qwenvl_patch.scoring.video_eval import TIOU_THRESHOLDS, ToFrame, VideoEval
from llamafactory_qwenvl_patch.frame.policy import convert_coords
from llamafactory_qwenvl_patch.frame.stamp import Stamp
from llamafactory_qwenvl_patch.image_io.video import probe
from qwenvl_prep.plumbing.atomic import atomic_writer
from qwenvl_prep.formats.predictions import AlignmentError, aligned
from qwenvl_prep.formats.converted import DatasetRef, Sample
from qwenvl_prep.plumbing.imageinfo import read_info
from qwenvl_prep.pipeline.convert_video import list_fps

BUCKETS = ((0.5e6, "<0.5 MP"), (2e6, "0.5-2 MP"), (8e6, "2-8 MP"), (float("inf"), ">=8 MP"))


def _bucket(width: int, height: int) -> str:
    return next(name for limit, name in BUCKETS if width * height < limit)


def _to_orig(coords, stamp: Stamp, hw: tuple[int, int], model_hw: tuple[int, int]) -> list[float]:
    return convert_coords(coords, stamp.coords, "orig", hw, model_hw, ndigits=None)


def _track_to_orig(where: str, sample: Sample, stamp: Stamp, sizes: dict[Any, tuple[int, int]]) -> ToFrame:
    """A track record's boxes from the stamp's video frame to the clip's pixels: the clip's size from its file
    (packet headers, nothing decoded; once per clip in ``sizes``), its frame from the stamp's video policy."""
    if len(sample.videos) != 1:
        raise AlignmentError(f"{where} has a track and {len(sample.videos)} videos; needs 1")
    if stamp.video is None:
        raise AlignmentError(f"{where} has a track, but the dataset's stamp has no video policy, so the frame of its "
                             "boxes is unknown; convert it with qwenvl-prep convert")
    video = sample.videos[0]
    key = tuple(video) if isinstance(video, list) else video
    if key not in sizes:
        clip = probe(video, list_fps(stamp))
        sizes[key] = (clip.height, clip.width)
    hw = sizes[key]
    return partial(_to_orig, stamp=stamp, hw=hw, model_hw=stamp.video.frame_size(*hw))


def evaluate(ref: DatasetRef, stamp: Stamp, predictions: Path, by: Sequence[str] = (),
             per_record: list[tuple[str | None, Any]] | None = None) -> dict[str, Any]:
    """Grounding records: Acc@0.5 (IoU >= 0.5, one-to-one matching), mean IoU, parse failures and centre offset,
    overall and by size; click accuracy for records with a truth box in ``meta`` (ScreenSpot, RefCOCO); detection
    precision / recall / F1 and COCO mAP; the detection-hack monitors; click and box metrics per value of the ``meta``
    fields ``by``; how "not present" records (answer ``[]``) were answered. Field-extraction records (a JSON object
    or array answer): per-field accuracy, all-fields-exact, format-valid and parse-failure rates. Video records
    (``video_eval``: the reference is a span or a track): R@1 at tIoU 0.3 / 0.5 / 0.7, mean tIoU and the span
    monitors; per-frame Acc@0.5 and mean IoU of tracks in the clip's pixels; how empty tracks (``[]`` with a
    video: not in the video) were answered; all per subset with ``by``. Other records are counted and skipped.
    ``per_record``, when given, receives each scored record's (subset, its own one-record tally), in order: what
    ``eval_report`` resamples for confidence intervals."""
    grounding, buckets, groups, fields, skipped = GroundingEval(), {}, {}, FieldTally(), 0
    video, video_groups, clip_sizes = VideoEval(), {}, {}
    index = -1
    for index, sample, text in aligned(ref, predictions):
        if sample.error:
            raise AlignmentError(f"record {index} of {ref.path} cannot be evaluated: {sample.error}")
        kind = reference_kind(sample.answer)
        if kind is not None or (sample.videos and not_present(sample.answer)):
            to_orig = (_track_to_orig(f"record {index} of {ref.path}", sample, stamp, clip_sizes)
                       if kind == "track" else None)
            args = (sample.answer, text, sample.meta, to_orig, bool(sample.videos))
            video.add(*args)
            if by:
                video_groups.setdefault(_group(sample.meta, by), VideoEval()).add(*args)
            _keep(per_record, sample.meta, by, VideoEval(), args)
            continue
        if not is_grounding(sample.items, sample.answer, sample.meta):
            truth = reference_value(sample.answer)
            if truth is None:
                skipped += 1
            else:
                fields.add(score_fields(text, truth))
                _keep(per_record, sample.meta, by, FieldTally(), (score_fields(text, truth),))
            continue
        if len(sample.images) != 1:
            raise AlignmentError(f"record {index} of {ref.path} has boxes and {len(sample.images)} images; needs 1")
        info = read_info(sample.images[0])
        hw = info.hw
        model_hw = stamp.policy.model_size(*hw)
        args = (sample.items, text, sample.meta, partial(_to_orig, stamp=stamp, hw=hw, model_hw=model_hw),
                (info.width, info.height))
        grounding.add(*args)
        buckets.setdefault(_bucket(info.width, info.height), GroundingEval(detection_on=False)).add(*args)
        if by:
            groups.setdefault(_group(sample.meta, by), GroundingEval(detection_on=False)).add(*args)
        _keep(per_record, sample.meta, by, GroundingEval(detection_on=False), args)
    result: dict[str, Any] = {"dataset": str(ref.path), "predictions": str(predictions), "records": index + 1,
                              "skipped_other": skipped}
    summary = grounding.to_dict()
    if "boxes" in summary:
        result.update({
            "iou_threshold": f"IoU >= {IOU_THRESHOLD}",
            "overall": summary.pop("boxes"),
            "by_size": {name: buckets[name].boxes.to_dict() for _, name in BUCKETS
                        if name in buckets and buckets[name].boxes.samples},
        })
    result.update(summary)
    result.update(video.to_dict())
    if by:
        result["by"] = {name: {**groups.get(name, GroundingEval()).to_dict(),
                               **video_groups.get(name, VideoEval()).to_dict()}
                        for name in sorted({*groups, *video_groups})}
    if fields.samples:
        result["fields"] = fields.to_dict()
    return result


def _keep(per_record: list[tuple[str | None, Any]] | None, meta: Any, by: Sequence[str], tally: Any,
          args: tuple) -> None:
    """The record's own tally, for resampling (``per_record`` given)."""
    if per_record is not None:
        tally.add(*args)
        per_record.append((_group(meta, by) if by else None, tally))


def _group(meta: Any, fields: Sequence[str]) -> str:
    """``platform=ios, data_type=icon``: the subset a record belongs to (``-`` for a field it lacks)."""
    values = meta if isinstance(meta, dict) else {}
    return ", ".join(f"{name}={values.get(name, '-')}" for name in fields)


def format_table(result: dict[str, Any]) -> str:
    sections = []
    if "overall" in result:
        sections.append(_grounding_table(result))
    if "not_present" in result:
        sections.append(_absent_line("not present (answer [])", result["not_present"]))
    if "clicks" in result:
        sections.append(_clicks_table(result))
    if "detection" in result:
        sections.append(_detection_table(result["detection"], result.get("monitors")))
    if "spans" in result:
        sections.append(_spans_table(result))
    if "tracks" in result:
        sections.append(_tracks_table(result))
    if "video_not_present" in result:
        sections.append(_absent_line("not in the video (empty track [])", result["video_not_present"]))
    if "fields" in result:
        sections.append(_fields_table(result["fields"]))
    if not sections:
        sections.append(f"no grounding, video or field-extraction records ({result['skipped_other']} other records)")
    return "\n\n".join(sections)


def _absent_line(what: str, row: dict[str, Any]) -> str:
    return (f"{what}: {row['samples']} records; answered [] {_fmt(row['said_nothing_rate'], '.3f')}, answered with "
            f"boxes (false positives) {_fmt(row['false_positive_rate'], '.3f')}, parse failures "
            f"{_fmt(row['parse_failure_rate'], '.3f')}")


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def _grounding_table(result: dict[str, Any]) -> str:
    acc = f"acc@{IOU_THRESHOLD}"
    header = (f"{'bucket':<10} {'samples':>7} {'boxes':>6} {'Acc@0.5':>8} {'mIoU':>7} {'parse fail':>10} "
              f"{'offset px':>10}")
    lines = [f"Acc@0.5 counts a ground-truth box as found when its matched prediction has {result['iou_threshold']}",
             header]
    for name, row in [("overall", result["overall"]), *result["by_size"].items()]:
        lines.append(f"{name:<10} {row['samples']:>7} {row['truth_boxes']:>6} {_fmt(row[acc], '8.3f')} "
                     f"{_fmt(row['mean_iou'], '7.3f')} {_fmt(row['parse_failure_rate'], '10.3f')} "
                     f"{_fmt(row['mean_centre_offset_orig_px'], '10.1f')}")
    lines.append("offset px: mean distance between the centres of matched boxes, in original pixels; "
                 "-: nothing to measure in that bucket (no box matched, or no records)")
    return "\n".join(lines)


def _clicks_table(result: dict[str, Any]) -> str:
    rows = _subset_rows(result, "clicks")
    width = max(len(name) for name, _ in rows)
    lines = ["clicks: a click is right when its point (or its box's centre) lies in the truth box, in original pixels",
             f"{'subset':<{width}} {'samples':>7} {'click acc':>9} {'dense':>6} {'no click':>8}"]
    lines += [f"{name:<{width}} {row['samples']:>7} {_fmt(row['click_acc'], '9.3f')} "
              f"{_fmt(row['click_dense_mean'], '6.3f')} {_fmt(row['no_click_rate'], '8.3f')}" for name, row in rows]
    firsts = [(name, row) for name, row in rows if "first_box_acc@0.5" in row]
    if firsts:
        lines += ["referring expressions (box labels): the answer's first box at IoU >= 0.5 with the truth box, the "
                  "accuracy RefCOCO results are published as", f"{'subset':<{width}} {'samples':>7} {'acc@0.5':>9}"]
        lines += [f"{name:<{width}} {row['first_box_samples']:>7} {_fmt(row['first_box_acc@0.5'], '9.3f')}"
                  for name, row in firsts]
    return "\n".join(lines)


def _detection_table(detection: dict[str, Any], monitors: dict[str, Any] | None) -> str:
    lines = [f"detection: {detection['images']} images, {detection['truth_boxes']} true and "
             f"{detection['predicted_boxes']} predicted boxes; at IoU >= {IOU_THRESHOLD} (one-to-one, label-aware) "
             f"precision {_fmt(detection['precision@0.5'], '.3f')}, recall {_fmt(detection['recall@0.5'], '.3f')}, "
             f"F1 {_fmt(detection['f1@0.5'], '.3f')}; COCO mAP@[.5:.95] {_fmt(detection['map'], '.3f')} "
             f"(AP50 {_fmt(detection['ap50'], '.3f')}, AP75 {_fmt(detection['ap75'], '.3f')}; every box scores 1)"]
    if monitors:
        lines.append(f"monitors: whole-image boxes {_fmt(monitors['whole_image_rate'], '.3f')}, empty answers "
                     f"{_fmt(monitors['empty_answer_rate'], '.3f')}, duplicates {_fmt(monitors['duplicate_rate'], '.3f')}"
                     f", median area ratio {_fmt(monitors['area_ratio_median'], '.2f')}, box count ratio "
                     f"{_fmt(monitors['count_ratio'], '.2f')} (predicted / true)")
    return "\n".join(lines)


def _subset_rows(result: dict[str, Any], kind: str) -> list[tuple[str, dict[str, Any]]]:
    """``kind``'s summary overall, then per ``--by`` subset that has such records."""
    return [("overall", result[kind])] + [(name, group[kind]) for name, group in result.get("by", {}).items()
                                          if kind in group]


def _spans_table(result: dict[str, Any]) -> str:
    rows = _subset_rows(result, "spans")
    width = max(len(name) for name, _ in rows)
    recall = " ".join(f"{'R@1 ' + str(t):>8}" for t in TIOU_THRESHOLDS)
    lines = ["temporal spans: R@1 counts a record when the answer's first span has tIoU >= the threshold with the "
             "truth",
             f"{'subset':<{width}} {'samples':>7} {recall} {'mIoU':>6} {'parse fail':>10}"]
    for name, row in rows:
        recall = " ".join(_fmt(row[f"r1@{t}"], "8.3f") for t in TIOU_THRESHOLDS)
        lines.append(f"{name:<{width}} {row['samples']:>7} {recall} {_fmt(row['mean_tiou'], '6.3f')} "
                     f"{_fmt(row['parse_failure_rate'], '10.3f')}")
    monitors = result["span_monitors"]
    lines.append(f"monitors: whole clip {_fmt(monitors['span_whole_clip_rate'], '.3f')}, empty or inverted "
                 f"{_fmt(monitors['span_degenerate_rate'], '.3f')}, beyond the clip "
                 f"{_fmt(monitors['span_beyond_clip_rate'], '.3f')}, more spans than the truth "
                 f"{_fmt(monitors['span_many_spans_rate'], '.3f')}, no span "
                 f"{_fmt(monitors['span_empty_answer_rate'], '.3f')}, median length ratio "
                 f"{_fmt(monitors['span_length_ratio_median'], '.2f')} (predicted / true)")
    return "\n".join(lines)


def _tracks_table(result: dict[str, Any]) -> str:
    rows = _subset_rows(result, "tracks")
    width = max(len(name) for name, _ in rows)
    lines = ["box tracks: each truth time takes the box at the nearest predicted time (within half the truth's "
             "spacing, at most 0.5 s); Acc@0.5 and mIoU over truth times; track = summed IoU over truth times plus "
             "extra boxes",
             f"{'subset':<{width}} {'samples':>7} {'frames':>6} {'Acc@0.5':>8} {'mIoU':>6} {'track':>6} "
             f"{'parse fail':>10}"]
    lines += [f"{name:<{width}} {row['samples']:>7} {row['frames']:>6} {_fmt(row[f'acc@{IOU_THRESHOLD}'], '8.3f')} "
              f"{_fmt(row['mean_iou'], '6.3f')} {_fmt(row['mean_track_score'], '6.3f')} "
              f"{_fmt(row['parse_failure_rate'], '10.3f')}" for name, row in rows]
    return "\n".join(lines)


def _fields_table(fields: dict[str, Any]) -> str:
    lines = [f"field extraction: {fields['samples']} records; all fields exact "
             f"{_fmt(fields['all_fields_exact'], '.3f')}, format valid {_fmt(fields['format_valid_rate'], '.3f')}, "
             f"parse failures {_fmt(fields['parse_failure_rate'], '.3f')}, mean fields reward "
             f"{_fmt(fields['mean_fields_reward'], '.3f')}",
             f"{'field':<32} {'accuracy':>8}"]
    lines += [f"{path:<32} {accuracy:>8.3f}" for path, accuracy in fields["per_field_accuracy"].items()]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Bar charts: grounding accuracy by original image size, and field accuracy per field."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [key for key in ("by_size", "fields") if key in result]
    if not panels:
        raise ValueError("nothing to plot: no grounding or field-extraction records")
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "by_size":
            names = list(result["by_size"])
            acc = [result["by_size"][n][f"acc@{IOU_THRESHOLD}"] or 0 for n in names]
            miou = [result["by_size"][n]["mean_iou"] or 0 for n in names]
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], acc, 0.4, label="Acc@0.5")
            ax.bar([x + 0.2 for x in xs], miou, 0.4, label="mean IoU")
            ax.set_xticks(list(xs), names)
            ax.legend()
            ax.set_title("Grounding accuracy by original image size")
        else:
            per_field = result["fields"]["per_field_accuracy"]
            ax.bar(range(len(per_field)), list(per_field.values()))
            ax.set_xticks(list(range(len(per_field))), list(per_field), rotation=30, ha="right")
            ax.set_title("Field accuracy")
        ax.set_ylim(0, 1)
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
