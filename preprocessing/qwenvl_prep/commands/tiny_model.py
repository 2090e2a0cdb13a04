"""``qwenvl-prep tiny-model``: a tiny random-weight Qwen-VL checkpoint, built offline for smoke tests."""

from __future__ import annotations

import argparse
import json

from llamafactory_qwenvl_patch.frame.families import DEFAULT, FAMILIES
from qwenvl_prep.demos.tiny_model import SIZES as TINY_SIZES


def run(args: argparse.Namespace) -> int:
    """Build the checkpoint and print where it went as JSON."""
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    out = build_tiny_model(args.out, family=args.family, seed=args.seed, size=args.size, moe=args.moe)
    print(json.dumps({"model_dir": str(out), "family": args.family, "size": args.size, "moe": args.moe}))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    tiny = sub.add_parser(
        "tiny-model",
        help="build a tiny random-weight Qwen-VL checkpoint offline (CPU smoke tests)",
        description="Write a few-MB random-weight Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 (real architecture, "
        "byte-level BPE tokenizer with the Qwen special tokens, processor, chat template) that LLaMA-Factory loads.",
    )
    tiny.add_argument("out", help="output folder (must not exist or be empty)")
    tiny.add_argument("--family", choices=[name for name, f in FAMILIES.items() if f.tiny], default=DEFAULT)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--moe", action="store_true", help="the mixture-of-experts variant (qwen3_5 only)")
    tiny.add_argument("--size", choices=list(TINY_SIZES), default="tiny",
                      help="tiny: fastest, for tests; small: ~1M parameters, enough to learn the demo's task")
    tiny.set_defaults(func=run)
