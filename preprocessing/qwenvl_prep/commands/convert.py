"""``qwenvl-prep convert``: grounding data in original-image coordinates -> LF sharegpt in the model's frame."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qwenvl_prep.formats.benchmarks import DEFAULT_TARGET, PROMPTS
from qwenvl_prep.formats.coco import CROWD_MODES, DEFAULT_PROMPT as DEFAULT_COCO_PROMPT
from qwenvl_prep.formats.prompt_presets import PRESET_NAMES
from qwenvl_prep.formats.temporal import FORMATS as VIDEO_FORMATS, PROMPTS as VIDEO_PROMPTS
from qwenvl_prep.formats.temporal_datasets import FORMATS as DATASET_FORMATS, PROMPTS as DATASET_PROMPTS
from qwenvl_prep.commands.options import add_policy_flags, count, print_summary, spec_from_args

FORMATS = ["auto", "sharegpt", "alpaca", "jsonl", "coco", *DEFAULT_TARGET, *VIDEO_FORMATS, *DATASET_FORMATS]


def _shard(text: str) -> tuple[int, int]:
    """``--shard``: i/n, this run's share of the records."""
    try:
        index, total = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes i/n, got {text!r}") from None
    if not 0 <= index < total:
        raise argparse.ArgumentTypeError(f"--shard i/n needs 0 <= i < n, got {text!r}")
    return index, total


def _absent(text: str) -> int:
    """``--coco-absent``: a count, or ``all`` (-1)."""
    if text == "all":
        return -1
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--coco-absent takes a count >= 0 or 'all', got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    """Convert, print the JSON summary, and say on stderr what was dropped and what a COCO file gave."""
    from qwenvl_prep.formats.coco import CocoOptions
    from qwenvl_prep.pipeline.convert import ConvertOptions, convert

    opts = ConvertOptions(
        input=args.input, output=args.output, target=spec_from_args(args).stamp, input_coords=args.input_coords,
        fmt=args.format, image_dir=args.image_dir, video_dir=args.video_dir, exif=args.exif,
        video_rotation=args.video_rotation, workers=args.workers, shard=args.shard, skip_bad=args.skip_bad,
        errors=args.errors, dataset_name=args.dataset_name, answer_target=args.answer_target,
        prompt=args.prompt, prompt_preset=args.prompt_preset, refcoco_expressions=args.refcoco_expressions,
        progress=not args.quiet, overwrite=args.overwrite,
        coco=CocoOptions(prompt=args.coco_prompt, group=args.coco_group, crowd=args.coco_crowd, absent=args.coco_absent),
    )
    summary, code = convert(opts)
    if summary["dropped"]:
        verb = "skipped" if code == 0 else "found; nothing was written"
        print(f"{summary['dropped']} bad record(s) {verb}: see {summary['error_report']}", file=sys.stderr)
    if "coco" in summary:
        print(_coco_note(summary["coco"]), file=sys.stderr)
    return print_summary(summary, code)


def _coco_note(coco: dict) -> str:
    """One line on what a COCO file gave and what it left out, and why."""
    note = (f"COCO: {coco['images']} images, {coco['annotations']} annotations (images from {coco['image_dir']}) -> "
            f"{coco['samples_with_boxes']} samples with boxes, {coco['samples_not_present']} 'not present' samples")
    if coco["images_without_annotations"]:
        note += (f"; {coco['images_without_annotations']} images have no annotation"
                 + ("" if coco["samples_not_present"] else " and gave no sample (--coco-absent N asks about absent "
                    "categories)"))
    if coco["samples_dropped_for_crowd"]:
        note += (f"; {coco['samples_dropped_for_crowd']} samples with crowd regions not written (--coco-crowd "
                 "ignore|box keeps them)")
    return note


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    conv = sub.add_parser(
        "convert",
        help="convert grounding data to LF sharegpt in the model's frame, stamped with the policy",
        description="Read LF sharegpt/alpaca JSON or JSONL (with images and/or videos), COCO instances, ScreenSpot / "
        "ScreenSpot-v2 / ScreenSpot-Pro annotation files, lmms-eval RefCOCO parquet, plain {image, question, answer} "
        "JSONL, video grounding files (video-span: your own span files; video-track: per-frame box tracks), or the "
        "temporal datasets as distributed (charades-sta txt, activitynet-captions json, qvhighlights jsonl); rewrite every bbox_2d / point_2d / <|box_start|> coordinate into the frame the model sees "
        "under the run's resize policy (a video's boxes into the video policy's frame; times stay in seconds, "
        "checked against the clip); write LF sharegpt and merge a stamped entry into dataset_info.json beside it. "
        "Videos are probed from their packets, never decoded.",
    )
    conv.add_argument("input", type=Path, help="input file (.json, .jsonl, .parquet, a COCO instances .json, or Charades-STA's .txt)")
    conv.add_argument("-o", "--output", type=Path, required=True, help="output .json or .jsonl (in the dataset_dir)")
    add_policy_flags(conv)
    conv.add_argument("--input-coords", choices=["abs", "rel1000", "rel1"],
                      help="convention of the input coordinates: abs = original-image pixels (COCO is always abs). "
                      "Required when records have coordinates; never guessed")
    conv.add_argument("--format", choices=FORMATS, default="auto",
                      help="input format (default: auto, from the first record; .parquet is refcoco-parquet; a "
                      "'video' entry with 'track' is video-track, with 'timestamp' / 'timestamps' / 'span' video-span; "
                      "'VID START END##sentence' lines are charades-sta, an object of videos with 'timestamps' and "
                      "'sentences' activitynet-captions, lines with 'vid', 'query' and 'relevant_windows' "
                      "qvhighlights)")
    conv.add_argument("--image-dir", type=Path, help="base folder of relative image paths, and of video paths unless "
                      "--video-dir is given (default: the input's folder; for COCO, the folder found as described "
                      "below)")
    conv.add_argument("--video-dir", type=Path, help="base folder of relative video paths; for charades-sta, "
                      "activitynet-captions and qvhighlights the folder that holds the clips, found by video id "
                      "(default: --image-dir, else the input's folder)")
    conv.add_argument("--exif", choices=["error", "bake", "raw"], default="error",
                      help="images with an EXIF rotation: error (default), bake = write an upright copy and read "
                      "coordinates on the displayed image, raw = coordinates are on the stored pixels")
    conv.add_argument("--video-rotation", choices=["error", "bake", "raw"], default="error",
                      help="clips whose display matrix turns them (phone clips): error (default), bake = write an "
                      "upright copy (re-encoded, no audio) and read labels on the displayed clip, raw = labels are on "
                      "the stored frames, as training reads them")
    conv.add_argument("--workers", type=count(1), default=os.cpu_count() or 1, help="parallel worker processes")
    conv.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N", help="convert records with index %% N == I")
    conv.add_argument("--skip-bad", action="store_true", help="drop bad records (listed in the error report), exit 0")
    conv.add_argument("--errors", type=Path, help="error report path (default: OUTPUT.errors.jsonl)")
    conv.add_argument("--dataset-name", help="dataset_info.json entry name (default: the output's stem)")
    conv.add_argument("--overwrite", action="store_true",
                      help="replace an existing dataset_info.json entry of the same name (refused otherwise)")
    coco = conv.add_argument_group(
        "COCO instances", "Images are looked up under --image-dir, else under the one folder near the JSON that holds "
        "them: the JSON's folder, the folder above it, its images/, its <split>/ and images/<split>/ (split from the "
        "file name: annotations/instances_val2017.json -> val2017/); two folders holding them is an error")
    coco.add_argument("--coco-prompt", default=DEFAULT_COCO_PROMPT,
                      help="prompt template, {category} is replaced (default: %(default)r)")
    coco.add_argument("--coco-group", choices=["category", "image"], default="category",
                      help="one conversation per (image, category) (default) or per image")
    coco.add_argument("--coco-crowd", choices=CROWD_MODES, default="drop",
                      help="iscrowd regions: drop (default) = a sample whose category has a crowd region in the image "
                      "is not written, since its answer cannot list every object; ignore = leave the crowd region "
                      "out of the answer; box = a crowd region is one more box")
    coco.add_argument("--coco-absent", type=_absent, default=0, metavar="N|all",
                      help="per image, N 'not present' samples (answer []) asking for categories the image has no "
                      "annotation of, chosen at random (seeded by the image id), or all of them (default 0: only "
                      "when your annotations are exhaustive do missing boxes mean absent objects)")
    conv.add_argument("--target", dest="answer_target", choices=["point", "box"],
                      help="ScreenSpot / RefCOCO: answer with the element's point_2d (its box centre) or its bbox_2d "
                      "(default: point for ScreenSpot, box for RefCOCO); the truth box goes to meta.bbox_orig either way")
    conv.add_argument("--prompt", help="ScreenSpot / RefCOCO prompt template, {instruction} is replaced (default: "
                      f"{PROMPTS['point']!r} for points, {PROMPTS['box']!r} for boxes); video-span / video-track "
                      f"template, {{query}} is replaced (default: {VIDEO_PROMPTS['video-span']!r} and "
                      f"{VIDEO_PROMPTS['video-track']!r}; charades-sta and activitynet-captions take video-span's; "
                      f"qvhighlights, whose answers list every window: {DATASET_PROMPTS['qvhighlights']!r})")
    conv.add_argument("--prompt-preset", choices=PRESET_NAMES,
                      help="ScreenSpot / RefCOCO: the prompt (and target) that Qwen's published numbers for the "
                      "run's family were measured with, where it is answered in JSON (RefCOCO on Qwen2.5-VL, "
                      "Qwen3-VL, Qwen3.5); the others are for predict --prompt-preset (docs/evaluation.md lists "
                      "every preset and its source)")
    conv.add_argument("--refcoco-expressions", choices=["all", "first"], default="all",
                      help="RefCOCO: one record per referring expression (default) or per row (its first)")
    conv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=run)
