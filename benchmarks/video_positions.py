"""Where the text after a Qwen2.5-VL / Qwen2-VL video sits on the M-RoPE, stock against pinned (issue 49, item 1).

A 1280x720, 30-fps mp4 of 10 s, 1 min and 5 min, with LF's video defaults, then one question after it. Stock: LF
0.9.5's sampling (``qwenvl_prep.lf.drift``) and transformers 5.6's own ``get_rope_index`` (text at the video's start +
max(h, w) / merge). Pinned: the plugin's video policy and ``pretrained_rope_index`` (text at the video's largest
position + 1, as the models were pretrained and as vLLM places it). Printed: the first text token's position, where
the pretrained rule puts the text after the same video, and how far inside the video's time the stock text sits.
Pure arithmetic on the real functions: nothing is decoded; the inner model is transformers' own class built from a
tiny config (random weights: positions read the config only).

    .venv/bin/python benchmarks/video_positions.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from llamafactory_qwenvl_patch.frame.families import FAMILIES, LF_VIDEO_DEFAULTS, MERGE_SIZE, pinned_rope_families
from llamafactory_qwenvl_patch.frame.mrope import pretrained_rope_index
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from qwenvl_prep.lf.drift import VideoHeader, stock_llamafactory_video

TOKEN = MERGE_SIZE ** 2  # patches per video token
LENGTHS = {"10 s": 10, "1 min": 60, "5 min": 300}
WIDTH, HEIGHT, RATE = 1280, 720, 30
TEXT_BEFORE, TEXT_AFTER = 14, 12  # chat template and question tokens around the video


def row(model, family: str, grid: list[int], seconds: float, rule: str) -> int:
    """The first text token's position after the video, under transformers' own rule or the pretrained one."""
    config = model.config
    t, h, w = grid
    ids = [1] * TEXT_BEFORE + [config.video_token_id] * (t * h * w // TOKEN) + [1] * TEXT_AFTER
    row_ids = torch.tensor([ids])
    types = 2 * (row_ids == config.video_token_id).long()
    grids = torch.tensor([grid])
    spg = torch.tensor([seconds])
    if rule == "stock":
        extra = {"second_per_grid_ts": spg} if FAMILIES[family].video_clock == "seconds" else {}
        positions, _ = model.get_rope_index(row_ids, types, video_grid_thw=grids, **extra)
    else:
        tps = getattr(config.vision_config, "tokens_per_second", None)
        positions, _ = pretrained_rope_index(row_ids, types, None, grids, spg, None,
                                             config.vision_config.spatial_merge_size, tps)
    return int(positions[0, 0, TEXT_BEFORE + t * h * w // TOKEN])


def measure() -> list[dict]:
    from qwenvl_prep.demos.tiny_model import build_tiny_model
    import transformers
    from transformers import AutoConfig

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in pinned_rope_families():
            model = getattr(transformers, FAMILIES[family].rope_model)(AutoConfig.from_pretrained(build_tiny_model(Path(tmp) / family, family)))
            f = FAMILIES[family]
            policy = VideoPolicy.from_lf_keys(dict(LF_VIDEO_DEFAULTS), f.factor, f.video_clock)
            patch = f.factor // MERGE_SIZE
            for name, seconds in LENGTHS.items():
                stock = stock_llamafactory_video(VideoHeader(WIDTH, HEIGHT, seconds * RATE, float(seconds), RATE),
                                                 family)
                stock_grid = [stock.groups, stock.frame[0] // patch, stock.frame[1] // patch]
                plan = policy.plan([k / RATE for k in range(seconds * RATE)])
                h, w = policy.frame_size(HEIGHT, WIDTH)
                pinned_grid = [plan.groups, h // patch, w // patch]
                stock_at = row(model, family, stock_grid, stock.second_per_grid_ts, "stock")
                pretrained_at = row(model, family, stock_grid, stock.second_per_grid_ts, "pretrained")
                pinned_at = row(model, family, pinned_grid, plan.second_per_grid_ts, "pretrained")
                out.append({"family": family, "clip": name, "stock_text_at": stock_at,
                            "pretrained_rule_text_at": pretrained_at, "stock_off_by": pretrained_at - stock_at,
                            "pinned_text_at": pinned_at, "video_starts_at": TEXT_BEFORE + 1})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = measure()
    print("| family | clip | stock: text at | pretrained rule on the same video | stock off by | pinned: text at |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['clip']} | {r['stock_text_at']} | {r['pretrained_rule_text_at']} | "
              f"{r['stock_off_by']} | {r['pinned_text_at']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
