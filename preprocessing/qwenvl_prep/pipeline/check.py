"""``qwenvl-prep check``: a dataset against the training YAML, before any GPU hour is spent.

Stamp vs run, images readable, boxes inside the frame, image tokens vs ``cutoff_len``, and a drift audit of what
stock LLaMA-Factory (without the plugin) would do to these labels; videos as ``check_video`` reads them (clips
readable, headers vs packets, labels inside the clip and the video frame, video tokens).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from llamafactory_qwenvl_patch.image_io.images import ImageError
from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy, check_box, check_point
from llamafactory_qwenvl_patch.scoring.answers import Item, parse_items
from llamafactory_qwenvl_patch.frame.stamp import Stamp, differences
from qwenvl_prep.formats.converted import DatasetRef, iter_samples
from qwenvl_prep.lf.drift import DriftAudit, processor_bounds
from qwenvl_prep.plumbing.imageinfo import read_info
from qwenvl_prep.lf.dataset_rules import EntryError, entry_reader, images_of_turns
from qwenvl_prep.lf.run_spec import RunSpec, template_problem
from qwenvl_prep.pipeline.check_video import VideoChecker
from qwenvl_prep.plumbing.workers import init_worker

MAX_LISTED = 20


@dataclass
class Report:
    dataset: str
    file: str
    stamp: dict | None
    stamp_problems: list[str] = field(default_factory=list)
    setup_problems: list[str] = field(default_factory=list)  # the run's template, the registry entry's layout
    samples: int = 0
    images: int = 0  # image references: a file used by several records counts once per record
    image_files: set[str] = field(default_factory=set)  # the distinct files among them
    problems: list[dict] = field(default_factory=list)
    token_overflows: int = 0
    max_sequence_tokens: int = 0
    drift: dict[str, Any] = field(default_factory=dict)
    videos: int = 0  # video references, as images
    video_notes: list[dict] = field(default_factory=list)  # what does not fail the check (a header that lies)

    @property
    def ok(self) -> bool:
        return not self.stamp_problems and not self.setup_problems and not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "file": self.file, "ok": self.ok, "stamp": self.stamp,
                "stamp_problems": self.stamp_problems, "setup_problems": self.setup_problems, "samples": self.samples, "images": self.images,
                "distinct_image_files": len(self.image_files), "problems": self.problems, "token_overflows": self.token_overflows,
                "max_sequence_tokens": self.max_sequence_tokens, "drift": self.drift,
                **({"videos": self.videos, "video_notes": self.video_notes} if self.videos else {})}


def _text_counter(model: str | None):
    """Token counter from the model's tokenizer.json (no torch); a chars/3 estimate if there is none."""
    path = Path(model or "", "tokenizer.json")
    if model and path.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
    return lambda text: len(text) // 3 + 1


def _decode(path: str) -> str | None:
    from llamafactory_qwenvl_patch.image_io.images import decode, open_image

    try:
        decode(open_image(path), path)
    except ImageError as exc:
        return str(exc)
    return None


def _scan_image(image: str, policy: ResizePolicy) -> tuple[tuple[int, int], tuple[int, int]]:
    """(original, model) size from the header; ImageError or PolicyError when the image cannot be used."""
    info = read_info(image)
    return info.hw, policy.model_size(*info.hw)


def _items_by_image(sample: Any) -> list[tuple[int, list[Item]]]:
    """(image index, the labels on it) of a record with images: a single image's are every turn's labels; in a
    record of several, each turn's are on the image of the last turn that showed one (``images_of_turns``, the
    rule ``convert`` maps them by)."""
    if len(sample.images) == 1:
        return [(0, sample.turn_items)]
    if not sample.images:
        return []
    per_turn = [parse_items(text) for text in sample.turns]
    shown = images_of_turns(sample.turns, [bool(items) for items in per_turn], len(sample.images))
    return [(index, items) for index, items in zip(shown, per_turn) if items]


def _item_error(item: Item, stamp: Stamp, hw: tuple[int, int]) -> str | None:
    """Why a label does not fit the frame its stamp names (None when it fits)."""
    try:
        (check_box if item.kind == "bbox_2d" else check_point)(item.coords, stamp.coords, hw,
                                                               stamp.policy.model_size(*hw))
    except PolicyError as exc:
        return str(exc)
    return None


def _decode_all(jobs: list[tuple[int, str]], workers: int) -> Iterator[tuple[int, str, str]]:
    """(sample, image, error) for each image that does not fully decode, in parallel processes."""
    if not jobs:
        return
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=get_context("forkserver"),
                             initializer=init_worker, initargs=("qwenvl-prep check", os.getpid())) as pool:
        for (index, image), error in zip(jobs, pool.map(_decode, [p for _, p in jobs], chunksize=16)):
            if error:
                yield index, image, error


def check_dataset(ref: DatasetRef, spec: RunSpec, model: str | None = None, full_decode: bool = False,
                  workers: int = 1) -> Report:
    """One pass over the dataset (headers only unless ``full_decode``): the stamp, every image and label problem,
    the token estimate against ``cutoff_len``, and the drift audit (``drift.DriftAudit``)."""
    policy = spec.stamp.policy
    report = Report(ref.name, str(ref.path), ref.stamp.to_dict() if ref.stamp else None)
    if ref.stamp is None:
        report.stamp_problems.append("unstamped: coordinates cannot be checked against the run's frame "
                                     "(convert with `qwenvl-prep convert --from-yaml`)")
    else:
        report.stamp_problems += differences(ref.stamp, spec.stamp)
    if spec.patched and (problem := template_problem(spec.template)) is not None:
        report.setup_problems.append(problem)
    if ref.entry is not None:
        try:
            entry_reader(ref.entry)
        except EntryError as exc:
            report.setup_problems.append(f"{exc}; LF's reading of this entry cannot be checked")
            return report
    data_stamp = ref.stamp or spec.stamp
    drift = DriftAudit(policy, processor_bounds(model, spec.stamp.family))  # the run's family's hub bounds
    count_text = _text_counter(model)
    cutoff = spec.cutoff_len or 2048
    to_decode: list[tuple[int, str]] = []
    videos = VideoChecker(spec.stamp, data_stamp, full_decode, count_text)

    def problem(sample: int, image: str | None, message: str, key: str = "image") -> None:
        """One problem row, naming the image or clip (``key`` ``video``) it is about."""
        report.problems.append({"sample": sample, key: image, "error": message})

    for sample in iter_samples(ref):
        report.samples += 1
        if sample.error:
            problem(sample.index, sample.images[0] if sample.images else None, sample.error)
            continue
        tokens = count_text(sample.prompt + sample.answer) + 16
        if sample.videos:
            video_tokens, video_problems = videos.scan(sample)
            tokens += video_tokens
            for video, message in video_problems:
                problem(sample.index, video, message, "video")
        sizes: dict[int, tuple[tuple[int, int], tuple[int, int], tuple[int, int]]] = {}
        for shown, image in enumerate(sample.images):
            report.images += 1
            report.image_files.add(str(image))
            try:
                hw, model_hw = _scan_image(image, policy)
            except (ImageError, PolicyError) as exc:
                problem(sample.index, image, str(exc))
                continue
            if full_decode:
                to_decode.append((sample.index, image))
            tokens += policy.image_tokens(*hw) + 2
            sizes[shown] = hw, model_hw, drift.add_image(hw, model_hw)
        try:
            labelled = _items_by_image(sample)
        except ValueError as exc:
            problem(sample.index, None, str(exc))
            labelled = []
        for shown, items in labelled:
            if shown not in sizes:  # unreadable: named above
                continue
            hw, model_hw, stock_hw = sizes[shown]
            for item in items:
                error = _item_error(item, data_stamp, hw)
                if error:
                    problem(sample.index, sample.images[shown], error)
                elif data_stamp.coords == "model":
                    drift.add_label(item.coords, hw, model_hw, stock_hw)
        report.max_sequence_tokens = max(report.max_sequence_tokens, tokens)
        if tokens > cutoff:
            report.token_overflows += 1
            problem(sample.index, sample.images[0] if sample.images else None,
                    f"about {tokens} tokens (images and videos included) > cutoff_len {cutoff}: LF truncates inside "
                    "the image or video tokens and fails with 'features and tokens do not match'")
    for index, image, error in _decode_all(to_decode, workers):
        problem(index, image, error)
    report.drift = drift.to_dict()
    report.videos, report.video_notes = videos.videos, videos.notes
    if videos.videos and ref.stamp is not None and ref.stamp.video is None:
        report.stamp_problems.append("the dataset has videos but its stamp has no video policy: the frame of its video "
                                     "labels is unknown; convert it again with qwenvl-prep convert")
    return report


def format_report(report: Report) -> str:
    d = report.drift
    lines = [
        f"dataset {report.dataset} ({report.file}): {'OK' if report.ok else 'PROBLEMS'}",
        f"  samples {report.samples}, images {report.images} ({len(report.image_files)} distinct files), longest "
        f"sequence ~{report.max_sequence_tokens} tokens",
    ]
    if report.videos:
        lines.append(f"  videos {report.videos}, {len(report.video_notes)} note(s)")
    lines += [f"  stamp: {p}" for p in report.stamp_problems]
    lines += [f"  setup: {p}" for p in report.setup_problems]
    for row in report.problems[:MAX_LISTED]:
        lines.append(f"  sample {row['sample']}: {row['error']}")
    if len(report.problems) > MAX_LISTED:
        lines.append(f"  ... and {len(report.problems) - MAX_LISTED} more (see --json)")
    for row in report.video_notes[:MAX_LISTED]:
        lines.append(f"  note: sample {row['sample']}: video {row['video']}: {row['note']}")
    if len(report.video_notes) > MAX_LISTED:
        lines.append(f"  ... and {len(report.video_notes) - MAX_LISTED} more notes (see --json)")
    lines.append(
        f"  drift audit (stock LF without the plugin): {d['frames_changed']}/{d['images']} images "
        f"({100 * d['frames_changed_share']:.1f}%) get another frame, by up to {d['frame_max_px']} model px; "
        f"labels off by {d['label_mean_model_px']} model px on average (max {d['label_max_model_px']}), "
        f"{d['label_mean_orig_px']} original px (max {d['label_max_orig_px']})"
    )
    return "\n".join(lines)
