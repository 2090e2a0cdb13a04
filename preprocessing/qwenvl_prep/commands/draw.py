"""``qwenvl-prep draw``: ground truth and predictions on original or model-input images."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qwenvl_prep.commands.options import add_policy_flags, count, stamped_dataset


def run(args: argparse.Namespace) -> int:
    """Draw the sample and print where the drawings went as JSON."""
    from qwenvl_prep.pipeline.draw import draw

    ref, stamp = stamped_dataset(args)
    result = draw(ref, stamp, args.out, args.frame, args.sample, args.seed, args.predictions)
    print(json.dumps(result, indent=2))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    drw = sub.add_parser(
        "draw",
        help="draw ground truth (and predictions) on original or model-input images, plus a contact sheet",
        description="Draw boxes and points of a converted dataset with OpenCV: on the original image (coordinates "
        "mapped back) or on the exact image the model sees. A video record becomes a sheet of the frames the model "
        "samples (each track box on the frame nearest its time) above a timeline with the spans. Green: ground "
        "truth; red: predictions.",
    )
    drw.add_argument("dataset", help="dataset file or dataset_info name")
    drw.add_argument("-o", "--out", type=Path, required=True, help="output folder")
    drw.add_argument("--dataset-dir", default=".", help="folder of dataset_info.json when DATASET is a name")
    drw.add_argument("--frame", choices=["original", "model"], default="original")
    drw.add_argument("--sample", type=count(0), default=16, help="number of records to draw, 0 = all (default: %(default)s)")
    drw.add_argument("--seed", type=int, default=0)
    drw.add_argument("--predictions", type=Path,
                     help="JSONL aligned with the dataset by order, with a 'predict' field (LF generated_predictions)")
    add_policy_flags(drw)
    drw.set_defaults(func=run)
