"""How often stock LLaMA-Factory 0.9.5 feeds a video to Qwen2.5-VL / Qwen3-VL in another frame, or on another clock,
than the pinned video policy (``llamafactory_qwenvl_patch.frame.video``) with the same LF keys.

Pure arithmetic, nothing decoded: stock LF from ``qwenvl_prep.lf.drift`` (checked against LF's real plugin methods
in tests/unit/prep/test_video_drift.py), the policy from ``VideoPolicy``. Clips are constant-rate: frame ``i`` of a clip at
``r`` fps is on screen from ``i / r`` to ``(i + 1) / r``. Three ways a clip reaches LF: an mp4 (its header has the
frame count and duration), a webm or mkv (neither), a frame list taken at 1 fps (the policy told so by
``qwenvl_frame_list_fps: 1``; LF assumes ``video_fps``). The HF video processor's bounds are the hub checkpoints'
(the registry's ``hub_video_bounds``: per frame for Qwen2.5-VL, over all frames for Qwen3-VL).

Measures, stock LF against the policy:

- frame: the share of clips whose frame (height, width) differs; the largest difference at the far edge in model
  pixels, and in original pixels (for Qwen2.5-VL, which answers in model pixels, how far a label at the far edge
  lands; Qwen3-VL answers 0-1000 of the frame, so there the difference is resolution and tokens, not position);
- clock: a group's time on the model's clock (Qwen2.5-VL: its M-RoPE place, ``g * int(second_per_grid_ts)``
  seconds; Qwen3-VL: its ``<t seconds>`` stamp as printed) against when its frames are on screen (the first frame's
  span; for a stamp, the mean of the pair's spans); a clip's clock is off when a group is more than 0.05 s (the
  stamp's printed precision) outside; the worst last-group error over the clips;
- cut short: the share of clips whose sampled frames stop before 90% of the clip;
- the most video tokens one clip gets.

    .venv/bin/python benchmarks/video_drift_audit.py [--json out.json] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llamafactory_qwenvl_patch.frame.families import FAMILIES, LF_VIDEO_DEFAULTS
from llamafactory_qwenvl_patch.frame.video import VideoPolicy, frame_list_times
from qwenvl_prep.lf.drift import FrameList, VideoHeader, stock_llamafactory_video

SIZES = ["1920x1080", "1080x1920", "1280x720", "3840x2160", "2160x3840", "640x480", "2560x1440", "2880x1800",
         "1366x768"]
LENGTHS = [5, 10, 30, 60, 120, 300, 600]  # seconds
RATES = [24, 25, 30, 60]
MAX_PIXELS = [LF_VIDEO_DEFAULTS["video_max_pixels"], 200704, 602112]  # LF's default first
FAMILY_NAMES = ["qwen2_5_vl", "qwen3_vl"]
CONTAINERS = ["mp4", "webm/mkv", "frame list at 1 fps"]
LIST_FPS = 1.0
CLOCK_TOLERANCE = 0.05 + 1e-9  # seconds: a stamp is printed to 0.1 s
CUT_SHORT = 0.9


def outside(claimed: float, start: float, span: float) -> float:
    """How far ``claimed`` lies outside [start, start + span] (0 inside)."""
    return max(0.0, start - claimed, claimed - (start + span))


def clock_errors(claimed: list[float], starts: list[float], span: float) -> list[float]:
    return [outside(c, s, span) for c, s in zip(claimed, starts)]


def stock_clock(stock, clock: str) -> tuple[list[float], list[float]]:
    """(claimed time, real start) of each group under stock LF."""
    if clock == "seconds":
        return stock.positions, stock.group_starts
    return [float(f"{s:.1f}") for s in stock.stamps], stock.real_means


def policy_clock(plan, times: list[float], clock: str) -> tuple[list[float], list[float]]:
    """(claimed time, real start) of each group under the policy: the frames it decodes are on screen from
    ``times[index]``."""
    shown = [times[i] for i in plan.indices]
    if clock == "seconds":
        spg = int(plan.second_per_grid_ts)  # the truncation changes nothing: it is whole
        return [float(g * spg) for g in range(plan.groups)], shown[::2]
    return [float(f"{s:.1f}") for s in plan.stamps], [(a + b) / 2 for a, b in zip(shown[::2], shown[1::2])]


def clips(sizes: list[tuple[int, int]], lengths: list[float], rates: list[float], container: str):
    """(width, height, clip length, own rate, what LF reads) of each clip of the grid."""
    if container == "frame list at 1 fps":
        for (w, h) in sizes:
            for length in lengths:
                count = max(1, round(length * LIST_FPS))
                yield w, h, count, LIST_FPS, FrameList(w, h, count, LIST_FPS)
        return
    for (w, h) in sizes:
        for length in lengths:
            for rate in rates:
                count = max(1, round(length * rate))
                if container == "mp4":
                    yield w, h, count, rate, VideoHeader(w, h, count, count / rate, float(rate))
                else:
                    yield w, h, count, rate, VideoHeader(w, h, 0, None, float(rate), decoded=count)


class Tally:
    def __init__(self) -> None:
        self.clips = self.frames_differ = 0
        self.edge_model = self.edge_orig = 0.0
        self.side: dict[str, dict[str, float]] = {
            who: {"clock_off": 0, "worst_last": 0.0, "cut": 0, "worst_reach": 1.0, "tokens": 0}
            for who in ("stock", "policy")}

    def add_frame(self, w: int, h: int, stock_hw: tuple[int, int], policy_hw: tuple[int, int]) -> None:
        self.clips += 1
        if stock_hw != policy_hw:
            self.frames_differ += 1
            dh, dw = abs(stock_hw[0] - policy_hw[0]), abs(stock_hw[1] - policy_hw[1])
            self.edge_model = max(self.edge_model, dh, dw)
            self.edge_orig = max(self.edge_orig, dh * h / stock_hw[0], dw * w / stock_hw[1])

    def add_clock(self, who: str, claimed: list[float], starts: list[float], span: float, last_shown: float,
                  length: float, tokens: int) -> None:
        side = self.side[who]
        errors = clock_errors(claimed, starts, span)
        side["clock_off"] += max(errors) > CLOCK_TOLERANCE
        side["worst_last"] = max(side["worst_last"], errors[-1])
        reach = min(1.0, (last_shown + span) / length)
        side["cut"] += reach < CUT_SHORT
        side["worst_reach"] = min(side["worst_reach"], reach)
        side["tokens"] = max(side["tokens"], tokens)

    def to_dict(self, coords: str) -> dict:
        n = self.clips or 1
        return {
            "clips": self.clips,
            "frame_differs_share": round(self.frames_differ / n, 3),
            "frame_edge_model_px": round(self.edge_model),
            # where a far-edge label lands, in original pixels: only answers in model pixels move with the frame
            "label_shift_orig_px": round(self.edge_orig, 1) if coords == "model" else None,
            **{who: {"clock_off_share": round(s["clock_off"] / n, 3),
                     "worst_last_group_error_s": round(s["worst_last"], 2),
                     "cut_short_share": round(s["cut"] / n, 3), "worst_reach": round(s["worst_reach"], 3),
                     "most_tokens": s["tokens"]} for who, s in self.side.items()},
        }


def audit(family: str, max_pixels: int, container: str, sizes, lengths, rates) -> dict:
    fam = FAMILIES[family]
    keys = {**LF_VIDEO_DEFAULTS, "video_max_pixels": max_pixels}
    policy = VideoPolicy.from_lf_keys(keys, fam.factor, fam.video_clock)
    tally, plans = Tally(), {}
    for w, h, count, rate, clip in clips(sizes, lengths, rates, container):
        stock = stock_llamafactory_video(clip, family, **keys)
        if (count, rate) not in plans:  # the policy's sampling depends on the frame times only
            times = frame_list_times(count, rate)
            plans[count, rate] = times, policy.plan(times)
        times, plan = plans[count, rate]
        policy_hw = policy.frame_size(h, w)
        tally.add_frame(w, h, stock.frame, policy_hw)
        length = count / rate
        tally.add_clock("stock", *stock_clock(stock, fam.video_clock), stock.frame_span, stock.times[-1], length,
                        stock.groups * stock.frame[0] * stock.frame[1] // fam.factor ** 2)
        tally.add_clock("policy", *policy_clock(plan, times, fam.video_clock), 1.0 / rate, times[plan.indices[-1]],
                        length, plan.tokens(policy.frame_tokens(h, w)))
    return {"family": family, "answers": fam.coords, "video_max_pixels": max_pixels, "container": container,
            **tally.to_dict(fam.coords)}


def markdown(rows: list[dict]) -> str:
    lines = ["| family | `video_max_pixels` | clips from | clips | frame differs "
             "| far edge: model px (label shift, original px) | clock off: stock / policy "
             "| worst last-group error: stock / policy | frames stop before 90%: stock / policy "
             "| most tokens per clip: stock / policy |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, p = r["stock"], r["policy"]
        shift = "0-1000: none" if r["label_shift_orig_px"] is None else f"{r['label_shift_orig_px']:g}"
        edge = f"{r['frame_edge_model_px']} ({shift})" if r["frame_differs_share"] else "0"
        lines.append(
            f"| {r['family']} | {r['video_max_pixels']:,} | {r['container']} | {r['clips']} | "
            f"{r['frame_differs_share']:.0%} | {edge} | {s['clock_off_share']:.0%} / {p['clock_off_share']:.0%} | "
            f"{s['worst_last_group_error_s']:g} s / {p['worst_last_group_error_s']:g} s | "
            f"{s['cut_short_share']:.0%} / {p['cut_short_share']:.0%} | {s['most_tokens']:,} / {p['most_tokens']:,} |")
    return "\n".join(lines) + "\n"


def _sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def _numbers(kind):
    return lambda text: [kind(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=_sizes, default=_sizes(",".join(SIZES)), help="WxH,WxH,...")
    parser.add_argument("--lengths", type=_numbers(float), default=LENGTHS, help="clip lengths in seconds")
    parser.add_argument("--rates", type=_numbers(float), default=RATES, help="the clips' own frame rates")
    parser.add_argument("--max-pixels", type=_numbers(int), default=MAX_PIXELS, help="video_max_pixels values")
    parser.add_argument("--families", type=lambda t: t.split(","), default=FAMILY_NAMES)
    parser.add_argument("--json", type=Path, help="write the JSON here (default: stdout, before the table)")
    parser.add_argument("--markdown", type=Path, help="write the table here (default: stdout)")
    args = parser.parse_args(argv)
    rows = [audit(family, max_pixels, container, args.sizes, args.lengths, args.rates)
            for family in args.families for max_pixels in args.max_pixels for container in CONTAINERS]
    result = {"grid": {"sizes": [f"{w}x{h}" for w, h in args.sizes], "lengths_s": args.lengths,
                       "rates": args.rates, "frame_list_fps": LIST_FPS, "video_max_pixels": args.max_pixels,
                       "other_keys": {k: v for k, v in LF_VIDEO_DEFAULTS.items() if k != "video_max_pixels"},
                       "clock_tolerance_s": 0.05, "cut_short_below": CUT_SHORT},
              "results": rows}
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    if args.markdown:
        args.markdown.write_text(markdown(rows))
    else:
        sys.stdout.write(markdown(rows))
    return result


if __name__ == "__main__":
    main()
