"""``qwenvl-prep fix-config``: a model folder checked against the readers, and repaired for one of them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llamafactory_qwenvl_patch.model_files.readers import READERS
from qwenvl_prep.commands.options import spec_from_args


def run(args: argparse.Namespace) -> int:
    """Report on the folder (and rewrite it with --target or --flatten); exit 1 on problems."""
    from qwenvl_prep.pipeline.fix_config import inspect_model, repair_for, rewrite_flat

    bounds = None
    if args.yaml:
        stamp = spec_from_args(argparse.Namespace(from_yaml=args.yaml, family=None)).stamp
        bounds = (stamp.policy.min_pixels, stamp.policy.max_pixels)
    if args.dry_run and not args.target:
        raise ValueError("--dry-run goes with --target READER")
    rewrite = None
    if args.flatten:
        rewrite = rewrite_flat(args.model_dir)
    elif args.target:
        rewrite = repair_for(args.model_dir, args.target, args.dry_run)
    report = inspect_model(args.model_dir, bounds)
    if rewrite is not None:
        report["rewrite"] = rewrite
    print(json.dumps(report, indent=2))
    needs_repair = args.dry_run and bool(rewrite and rewrite["would_change"])
    return 1 if report["problems"] or needs_repair else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    fix = sub.add_parser(
        "fix-config",
        help="check a model folder against transformers 4.x/5.x and vLLM; repair it for one of them",
        description="Report the config layout, sub-config types, transformers version written vs installed, "
        "processor bounds vs a training YAML, and what each reader (transformers 4.49-4.51, 4.57, vLLM before 0.26, "
        "vLLM 0.26 and newer) cannot load or would load differently (`readers`: reader, file, key). --target READER "
        "rewrites the folder in the portable layout that transformers 4.49 to 5.x and every vLLM read in the training "
        "frame (what an export under `qwenvl_patch: true` writes), keeping each replaced file as NAME.bak-STAMP; it "
        "refuses, writing nothing, what it cannot repair. --flatten rewrites only config.json in the flat layout.",
    )
    fix.add_argument("model_dir", type=Path)
    fix.add_argument("--yaml", metavar="TRAIN.yaml", help="compare the processor bounds with this training YAML")
    mode = fix.add_mutually_exclusive_group()
    mode.add_argument("--target", choices=[*sorted(READERS), "vllm"], metavar="READER",
                      help=f"repair the folder so that this reader loads it in the training frame (backups kept): "
                      f"{', '.join(sorted(READERS))}, or vllm (the installed vLLM's; vllm-0.28 where none is)")
    mode.add_argument("--flatten", action="store_true", help="rewrite config.json in the flat layout (backup kept)")
    fix.add_argument("--dry-run", action="store_true",
                     help="with --target: list what would change, write nothing (exit 1 when something would)")
    fix.set_defaults(func=run)
