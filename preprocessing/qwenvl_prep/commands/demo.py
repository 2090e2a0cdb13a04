"""``qwenvl-prep demo``: the whole pipeline on 2 CPU cores, ending with a model that learned the task."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llamafactory_qwenvl_patch.frame.families import DEFAULT, FAMILIES
from qwenvl_prep.commands.options import count, finite, seed


def run(args: argparse.Namespace) -> int:
    """Run the demo; the JSON summary on stdout, a readable one on stderr."""
    from qwenvl_prep.demos.grounding import run_demo

    summary = run_demo(args.out, minutes=args.minutes, family=args.family, task=args.task, steps=args.steps,
                       seed=args.seed, controls=args.controls)
    print(json.dumps(summary, indent=2))
    if args.task == "grounding":
        from qwenvl_prep.demos.grounding import format_summary

        print(format_summary(summary), file=sys.stderr)
    elif args.task == "gui":
        from qwenvl_prep.demos.gui import format_gui_summary

        print(format_gui_summary(summary), file=sys.stderr)
    elif args.task == "agent":
        from qwenvl_prep.demos.agent import format_agent_summary

        print(format_agent_summary(summary), file=sys.stderr)
    elif args.task == "video":
        from qwenvl_prep.demos.video import format_video_summary

        print(format_video_summary(summary), file=sys.stderr)
    else:
        from qwenvl_prep.demos.fields import format_summary as format_fields_summary

        print(format_fields_summary(summary), file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    demo = sub.add_parser(
        "demo",
        help="the whole pipeline on 2 CPU cores, ending with a model that learned the task (minutes on idle cores: "
        "grounding about 4, gui 5, fields 7; video and agent about 8 of SFT each, more in all)",
        description="Synthesise a dataset (grounding: coloured rectangles on photos of mixed sizes; gui: screenshots "
        "at real screen sizes as a ScreenSpot file; fields: rendered invoices), build a small random-weight model, "
        "and run convert, check, llamafactory-cli train (SFT from scratch, then GRPO), export, predict, eval and "
        "draw into OUT. Held-out metrics of the trained model are printed next to the untrained model and a constant "
        "baseline measured in the same run; the JSON summary goes to stdout.",
    )
    demo.add_argument("out", type=Path, help="new output folder")
    demo.add_argument("--minutes", type=finite("--minutes", False),
                      help="SFT training budget in minutes of 2 CPU cores, turned into a fixed step count (default 3 "
                      "for grounding, 3.33 (1,300 steps) for gui, 8.1 (1,300 steps of two-screen trajectories) for agent, 3 (900 steps) for fields, 8.26 (900 steps) for video: the model learns "
                      "the task; less is a quicker smoke "
                      "run)")
    demo.add_argument("--steps", type=count(1),
                      help="SFT steps, instead of --minutes (both curriculum stages together for fields)")
    demo.add_argument("--seed", type=seed, default=0,
                      help="another seed draws another run (other images and initial weights; for fields also other "
                      "shuffles and samples), to see that learning is not one lucky draw (default %(default)s: the "
                      "numbers in docs/getting-started.md)")
    demo.add_argument("--controls", type=int,
                      help="gui: controls per screenshot, the instruction naming one (default 1: the model finds the "
                      "control; 2 or 3: it must also read which, and needs more steps: --minutes 8 for 2)")
    demo.add_argument("--family", choices=[name for name, f in FAMILIES.items() if f.tiny],
                      help=f"model family of the grounding, gui, video and agent demos (default {DEFAULT} for grounding, "
                      "qwen3_vl for gui, video and agent; Qwen2-VL, Qwen3-VL and Qwen3.5 answer in 0-1000)")
    demo.add_argument("--task", choices=["grounding", "gui", "fields", "video", "agent"], default="grounding",
                      help="grounding (boxes, the default); gui: screenshots at real screen sizes written as a "
                      "ScreenSpot file, 'click <label>' answered with a point, GRPO with click,click_dense,format, "
                      "click accuracy by platform and element type; fields: rendered invoices answered as JSON "
                      "objects, a two-stage resolution curriculum, GRPO with fields,format,no_cheat and the "
                      "blank-image control, field metrics; or video: clips in which a square appears and leaves, "
                      "answered with its span in seconds, GRPO with tiou,format, R@1 at tIoU and mean tIoU; or agent: SFT on "
                      "two-screen trajectories the simulator draws, then multi-turn GRPO against the shipped simulator "
                      "(qwenvl_prep.demos.gui_env:ClickThroughEnv, 2 screens a task), held-out tasks played by "
                      "qwenvl-prep agent-eval: success rate and steps to success")
    demo.set_defaults(func=run)
