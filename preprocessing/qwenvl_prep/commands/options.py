"""Argument types and flags that several subcommands share: the resize-policy flags and how they become a run's
frame, and argparse types that refuse nan, negative counts and seeds numpy cannot take before anything runs."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Callable

from llamafactory_qwenvl_patch.frame.families import DEFAULT, FAMILIES, LF_VIDEO_DEFAULTS
from llamafactory_qwenvl_patch.frame.keys import FrameKeyError, frame_key

if TYPE_CHECKING:
    from llamafactory_qwenvl_patch.frame.stamp import Stamp
    from qwenvl_prep.formats.converted import DatasetRef
    from qwenvl_prep.lf.run_spec import RunSpec


VIDEO_FLAGS = {"video_min_pixels": "--video-min-pixels", "video_max_pixels": "--video-max-pixels",
               "video_fps": "--video-fps", "video_maxlen": "--video-maxlen"}


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The run's policy: from the LF training YAML, or from explicit flags (LF's video keys as flags, its defaults
    for those not given); ``--frame-list-fps`` overrides either's frame-list rate."""
    from dataclasses import replace

    from qwenvl_prep.lf.run_spec import spec_from_flags, spec_from_yaml

    video_keys = {key: getattr(args, key) for key in VIDEO_FLAGS if getattr(args, key, None) is not None}
    given = [VIDEO_FLAGS[key] for key in video_keys]
    if args.from_yaml:
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with --from-yaml: the video policy is the YAML's "
                             "(video_min_pixels, video_max_pixels, video_fps, video_maxlen)")
        spec = spec_from_yaml(args.from_yaml, family=args.family)
        if not spec.patched:
            print(f"warning: {args.from_yaml} does not set `qwenvl_patch: true`; stock LLaMA-Factory resizes "
                  "differently and will not train in this frame", file=sys.stderr)
    else:
        if args.min_pixels is None or args.max_pixels is None:
            raise ValueError("give --from-yaml TRAIN.yaml, or both --min-pixels and --max-pixels")
        spec = spec_from_flags(args.min_pixels, args.max_pixels, args.family or DEFAULT, video_keys)
    if getattr(args, "frame_list_fps", None) is not None:
        spec = replace(spec, stamp=replace(spec.stamp, frame_list_fps=args.frame_list_fps))
    return spec


def finite(flag: str, zero_allowed: bool, note: str = "", least: float = 0.0,
           most: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 (at least ``least`` when given, at most ``most``), or also 0 with
    ``zero_allowed`` (nan and inf are mistakes, not values)."""
    bound = f">= {least:g}" if least else "> 0"
    bound = f"0 or {bound}" if zero_allowed and least else (">= 0" if zero_allowed else bound)
    bound += f" and <= {most:g}" if most < math.inf else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        positive = value >= least if least else value > 0
        if not (math.isfinite(value) and value <= most and (positive or (zero_allowed and value == 0))):
            raise argparse.ArgumentTypeError(f"{flag} takes a number {bound}{note}, got {text!r}")
        return value

    return parse


def frame_flag(key: str) -> Callable[[str], int | float]:
    """An argparse type for the flag of a frame key: its text as a number (``1e6`` too, as a YAML or LF's
    ``key=value`` override reads it), then the frame keys' one rule (``frame.keys.frame_key``)."""

    def parse(text: str) -> int | float:
        value: object = text
        for number in (int, float):
            try:
                value = number(text)
                break
            except ValueError:
                continue
        try:
            return frame_key(key, value)
        except FrameKeyError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def seed(text: str) -> int:
    """An argparse type: a seed numpy and torch both accept (0 to 2**32 - 1), refused here rather than in a
    training subprocess's log."""
    value = count(0)(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"a seed must be below 2**32, got {value}")
    return value


def count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least`` (a negative --workers or --sample is a mistake, not a default)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return parse


def print_summary(summary: dict, code: int) -> int:
    """The command's JSON summary on stdout; its exit code passed through."""
    print(json.dumps(summary, indent=2))
    return code


def stamped_dataset(args: argparse.Namespace) -> tuple[DatasetRef, Stamp]:
    """The dataset and the frame of its coordinates: its stamp, or the policy flags for an unstamped file."""
    from qwenvl_prep.formats.converted import resolve_dataset

    ref = resolve_dataset(args.dataset, args.dataset_dir)
    if ref.stamp is not None:
        return ref, ref.stamp
    if not args.from_yaml and args.min_pixels is None:
        raise ValueError(f"{ref.path} is unstamped: give --from-yaml or --min-pixels/--max-pixels/--family")
    return ref, spec_from_args(args).stamp


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    """The frame flags of every command that reads or writes coordinates: a training YAML, or explicit bounds."""
    group = parser.add_argument_group("resize policy (the run's frame)")
    group.add_argument("--from-yaml", metavar="TRAIN.yaml", help="read image_min_pixels, image_max_pixels, template "
                       "and the model family from the LLaMA-Factory training YAML (recommended)")
    group.add_argument("--min-pixels", type=frame_flag("image_min_pixels"),
                       help="pinned image_min_pixels (without --from-yaml; a whole number, 1e6 included, as "
                       "LLaMA-Factory reads it)")
    group.add_argument("--max-pixels", type=frame_flag("image_max_pixels"),
                       help="pinned image_max_pixels (without --from-yaml)")
    group.add_argument("--family", choices=list(FAMILIES),
                       help="model family: Qwen2.5-VL trains on absolute model-frame pixels, Qwen2-VL, Qwen3-VL and "
                       "Qwen3.5 on relative 0-1000 (default: from the YAML's model config or template, else "
                       "qwen2_5_vl)")
    video = parser.add_argument_group(
        "video policy (the run's video frame and sampling)", "With --from-yaml, the YAML's video_min_pixels, "
        "video_max_pixels, video_fps and video_maxlen (LLaMA-Factory's defaults "
        f"{', '.join(map(str, list(LF_VIDEO_DEFAULTS.values())[:-1]))} and {LF_VIDEO_DEFAULTS['video_maxlen']} for "
        "those it omits); without it, these flags (the same defaults)")
    video.add_argument("--video-min-pixels", type=frame_flag("video_min_pixels"),
                       help="pinned video_min_pixels (without --from-yaml)")
    video.add_argument("--video-max-pixels", type=frame_flag("video_max_pixels"),
                       help="pinned video_max_pixels (without --from-yaml)")
    video.add_argument("--video-fps", type=frame_flag("video_fps"), help="pinned video_fps (without --from-yaml)")
    video.add_argument("--video-maxlen", type=frame_flag("video_maxlen"),
                       help="pinned video_maxlen (without --from-yaml)")
    video.add_argument("--frame-list-fps", type=frame_flag("qwenvl_frame_list_fps"), metavar="FPS",
                       help="the rate videos given as frame lists (lists of image paths) were taken at; their frame "
                       "times, and so every time label, follow from it (default: the YAML's qwenvl_frame_list_fps, "
                       "else video_fps)")
