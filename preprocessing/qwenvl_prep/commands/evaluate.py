"""``qwenvl-prep eval``: predictions scored against a converted dataset in original pixels."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qwenvl_prep.commands.options import add_policy_flags, stamped_dataset


def run(args: argparse.Namespace) -> int:
    """Score the predictions; a table, or JSON with --json."""
    from qwenvl_prep.plumbing.atomic import write_json
    from qwenvl_prep.pipeline.evaluate import evaluate, format_table, plot
    from qwenvl_prep.formats.converted import guard_dataset_outputs

    ref, stamp = stamped_dataset(args)
    guard_dataset_outputs(ref, [args.predictions], {"--json-out": args.json_out, "--plot": args.plot})
    result = evaluate(ref, stamp, args.predictions, by=[f.strip() for f in (args.by or "").split(",") if f.strip()])
    if args.json_out:
        write_json(args.json_out, result)
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    ev = sub.add_parser(
        "eval",
        help="metrics in the original frame: Acc@0.5, mean IoU, click accuracy, detection F1 and mAP, video "
        "spans and tracks, by subset",
        description="Join predictions to a converted dataset by order (LF generated_predictions.jsonl: labels must "
        "match record by record; qwenvl-prep predict output: images must match) and score boxes in original "
        "pixels. Acc@0.5 counts a ground-truth box as found when its one-to-one matched prediction has IoU >= 0.5; "
        "records with a truth box in meta (ScreenSpot, RefCOCO) also get click accuracy (the answer's point, or its "
        "box's centre, inside the box); box records get precision / recall / F1 at IoU 0.5, COCO mAP@[.5:.95] "
        "(order-free, since answers carry no scores; pycocotools' own number beside it) and the detection-hack "
        "monitors. Video records: a span reference ({\"span\": [start, end]} seconds) gets R@1 at tIoU 0.3 / 0.5 / "
        "0.7, mean tIoU and the span-hack monitors; a track reference ([{\"time\": t, \"bbox_2d\": ...}]) gets "
        "Acc@0.5 and mean IoU per truth time and the track score, boxes in the dataset's frame.",
    )
    ev.add_argument("dataset", help="converted dataset file or dataset_info name")
    ev.add_argument("--predictions", type=Path, required=True)
    ev.add_argument("--dataset-dir", default=".", help="folder of dataset_info.json when DATASET is a name")
    ev.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ev.add_argument("--json-out", type=Path, help="also write the JSON result here")
    ev.add_argument("--plot", type=Path, help="bar chart by image size (PNG)")
    ev.add_argument("--by", metavar="FIELD,FIELD", help="also report each subset of records sharing these meta "
                    "values, e.g. --by platform,data_type (ScreenSpot) or --by group,ui_type (ScreenSpot-Pro)")
    add_policy_flags(ev)
    ev.set_defaults(func=run)
