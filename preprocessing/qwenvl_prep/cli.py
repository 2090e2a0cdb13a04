"""``qwenvl-prep`` command line. Subcommands import their heavy modules lazily, so ``--help`` answers fast."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence


def _tiny_model(args: argparse.Namespace) -> int:
    from qwenvl_prep.tiny_model import build_tiny_model

    out = build_tiny_model(args.out, family=args.family, seed=args.seed)
    print(json.dumps({"model_dir": str(out), "family": args.family}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwenvl-prep",
        description="Convert, check, draw and evaluate Qwen-VL grounding datasets in exactly the frame the model "
        "sees, under the same resize policy as `llamafactory-cli train` with `qwenvl_patch: true`.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = sub.add_parser(
        "tiny-model",
        help="build a tiny random-weight Qwen-VL checkpoint offline (CPU smoke tests)",
        description="Write a few-MB random-weight Qwen2.5-VL or Qwen3-VL (real architecture, byte-level BPE "
        "tokenizer with the Qwen special tokens, processor, chat template) that LLaMA-Factory loads.",
    )
    tiny.add_argument("out", help="output folder (must not exist or be empty)")
    tiny.add_argument("--family", choices=["qwen2_5_vl", "qwen3_vl"], default="qwen2_5_vl")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (FileExistsError, FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"qwenvl-prep {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
