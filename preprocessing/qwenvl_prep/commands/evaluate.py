"""``qwenvl-prep eval``: predictions scored against a converted dataset in original pixels."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qwenvl_prep.commands.options import add_policy_flags, count, stamped_dataset


def run(args: argparse.Namespace) -> int:
    """Score the predictions; a table, or JSON with --json; with --report or --compare, intervals too."""
    from qwenvl_prep.plumbing.atomic import atomic_writer, write_json
    from qwenvl_prep.pipeline.eval_report import intervals, report_markdown
    from qwenvl_prep.pipeline.evaluate import evaluate, format_table, plot
    from qwenvl_prep.formats.converted import guard_dataset_outputs

    ref, stamp = stamped_dataset(args)
    inputs = [args.predictions] + ([args.compare] if args.compare else [])
    guard_dataset_outputs(ref, inputs, {"--json-out": args.json_out, "--plot": args.plot, "--report": args.report})
    by = [f.strip() for f in (args.by or "").split(",") if f.strip()]
    wanted = args.report is not None or args.compare is not None
    records: list | None = [] if wanted else None
    result = evaluate(ref, stamp, args.predictions, by=by, per_record=records)
    if wanted:
        other: list | None = None
        if args.compare:
            other = []
            result["compare"] = evaluate(ref, stamp, args.compare, by=by, per_record=other)
        result["intervals"] = intervals(records, args.bootstrap, args.bootstrap_seed, other)
    if args.json_out:
        write_json(args.json_out, result)
    if args.plot:
        plot(result, args.plot)
    if args.report:
        with atomic_writer(args.report) as f:
            f.write(report_markdown(result, stamp.to_dict(), inputs))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


MAX_RESAMPLES = 100_000


def resamples(text: str) -> int:
    """An argparse type: 10 to MAX_RESAMPLES bootstrap resamples (more buys no precision, only time)."""
    value = count(10)(text)
    if value > MAX_RESAMPLES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_RESAMPLES}, got {value}")
    return value


def add_bootstrap_flags(parser: argparse.ArgumentParser) -> None:
    """The intervals' flags, shared with ``agent-eval``: how many resamples, and their seed."""
    parser.add_argument("--bootstrap", type=resamples, default=1000, metavar="N",
                        help="bootstrap resamples for the intervals (default 1000)")
    parser.add_argument("--bootstrap-seed", type=count(0), default=0, metavar="S", help="their seed (default 0)")


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
    ev.add_argument("--report", type=Path, metavar="FILE.md",
                    help="also write a Markdown report: the dataset, each predictions file's model, prompt and "
                    "settings (as qwenvl-prep predict recorded them), the versions, and per subset n, each metric "
                    "and its 95%% bootstrap interval (over records)")
    ev.add_argument("--compare", type=Path, metavar="PREDICTIONS_B",
                    help="a second predictions file of the same dataset: each metric of both and the paired "
                    "difference (PREDICTIONS - PREDICTIONS_B) with its interval, from the same resampled records")
    add_bootstrap_flags(ev)
    ev.add_argument("--by", metavar="FIELD,FIELD", help="also report each subset of records sharing these meta "
                    "values, e.g. --by platform,data_type (ScreenSpot) or --by group,ui_type (ScreenSpot-Pro)")
    add_policy_flags(ev)
    ev.set_defaults(func=run)
