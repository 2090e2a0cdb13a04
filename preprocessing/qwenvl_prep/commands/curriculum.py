"""``qwenvl-prep curriculum``: one converted dataset and one training YAML per resolution stage."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from qwenvl_prep.commands.convert import FORMATS
from qwenvl_prep.commands.options import count, print_summary


def run(args: argparse.Namespace) -> int:
    """Convert once per stage, write the stage YAMLs, print the JSON summary."""
    from qwenvl_prep.pipeline.curriculum import CurriculumOptions, parse_stages, run_curriculum

    summary = run_curriculum(CurriculumOptions(
        input=args.input, base_yaml=args.from_yaml, stages=parse_stages(args.stages), out=args.out,
        eval_input=args.eval_input, input_coords=args.input_coords, fmt=args.format, image_dir=args.image_dir,
        exif=args.exif, video_rotation=args.video_rotation, workers=args.workers, dataset_name=args.dataset_name,
        overwrite=args.overwrite, progress=not args.quiet))
    return print_summary(summary, 0)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    cur = sub.add_parser(
        "curriculum",
        help="a low-to-high resolution curriculum: one converted dataset and one training YAML per stage",
        description="Convert INPUT once per stage, each in the frame of that stage's image_max_pixels (stamped, so "
        "the qwenvl_patch guard accepts a stage's data only in that stage), and write OUT/stageK.yaml from the base "
        "YAML with that stage's bounds and dataset; each stage after the first resumes from the previous stage's "
        "output_dir (LoRA adapter, or full weights). Prints the stages and the command that runs them in order.",
    )
    cur.add_argument("input", type=Path, help="training data in original-image coordinates (any convert format)")
    cur.add_argument("--from-yaml", required=True, type=Path, metavar="BASE.yaml",
                     help="the training YAML every stage starts from (model, template, method, hyperparameters)")
    cur.add_argument("--stages", required=True, metavar="PIXELS,PIXELS,...",
                     help="image_max_pixels of each stage, low to high, e.g. 200704,1003520")
    cur.add_argument("-o", "--out", type=Path, required=True, help="folder for stageK.yaml and data/")
    cur.add_argument("--eval-input", type=Path, help="evaluation data, converted per stage like INPUT")
    cur.add_argument("--input-coords", choices=["abs", "rel1000", "rel1"],
                     help="convention of the input coordinates (required when records have coordinates)")
    cur.add_argument("--format", choices=FORMATS, default="auto")
    cur.add_argument("--image-dir", type=Path, help="base folder of relative image paths (default: the input's)")
    cur.add_argument("--exif", choices=["error", "bake", "raw"], default="error")
    cur.add_argument("--video-rotation", choices=["error", "bake", "raw"], default="error")
    cur.add_argument("--workers", type=count(1), default=os.cpu_count() or 1)
    cur.add_argument("--dataset-name", help="dataset name prefix (default: the input's stem)")
    cur.add_argument("--overwrite", action="store_true", help="replace existing stage YAMLs")
    cur.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    cur.set_defaults(func=run)
