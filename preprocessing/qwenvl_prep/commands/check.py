"""``qwenvl-prep check``: datasets against a training YAML (stamp, images, boxes, tokens, drift audit)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from qwenvl_prep.commands.options import count


def run(args: argparse.Namespace) -> int:
    """Check each dataset; exit 1 on any problem."""
    from qwenvl_prep.pipeline.check import check_dataset, format_report
    from qwenvl_prep.formats.converted import resolve_dataset
    from qwenvl_prep.lf.run_spec import load_yaml, spec_from_yaml

    spec = spec_from_yaml(args.yaml)
    names = args.datasets or list(spec.datasets)
    if not names:
        raise ValueError(f"{args.yaml} names no dataset; pass dataset names or files")
    model = load_yaml(args.yaml).get("model_name_or_path")
    reports = [check_dataset(resolve_dataset(name, spec.dataset_dir), spec, model, args.decode, args.workers)
               for name in names]
    if not spec.patched:
        print(f"warning: {args.yaml} does not set `qwenvl_patch: true`", file=sys.stderr)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        print("\n".join(format_report(r) for r in reports))
    return 0 if all(r.ok for r in reports) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    chk = sub.add_parser(
        "check",
        help="check datasets against a training YAML (stamp, images, boxes, tokens, drift audit)",
        description="Check that each dataset's stamp matches the YAML's bounds, factor and model family (and video "
        "policy), that every image and video is readable, that boxes lie inside the frame (a video's inside its "
        "video frame, its spans and track times inside the clip), that image and video tokens fit cutoff_len, and "
        "audit how far stock LLaMA-Factory (without the plugin) would put the labels from what the model sees. A "
        "clip whose packets stop before the length its header states is a problem (truncated or corrupt). Exit 1 on "
        "any problem.",
    )
    chk.add_argument("datasets", nargs="*", help="dataset_info names or files (default: the YAML's dataset list)")
    chk.add_argument("--yaml", required=True, metavar="TRAIN.yaml", help="the LLaMA-Factory training YAML")
    chk.add_argument("--decode", action="store_true", help="fully decode every image (parallel) and every video's "
                     "sampled frames, not just headers and packets")
    chk.add_argument("--workers", type=count(1), default=os.cpu_count() or 1)
    chk.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    chk.set_defaults(func=run)
