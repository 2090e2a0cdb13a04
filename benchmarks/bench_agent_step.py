"""One multi-turn GRPO training pass (forward + backward of the action tokens' log-probs), three layouts, one run:

- ``packed`` (``stage: grpo`` with ``grpo_agent_env``, the shared prefix on, the default): the G trajectories of the
  task packed behind its root (the task prompt and first screenshot computed once), each suffix attending to the
  root and to itself (``grpo/rollout/shared_prefix.py``), logits only where an action token is predicted;
- ``rows`` (``grpo_shared_prefix: false``): one row per trajectory (the task with its first screenshot,
  then each action and observation), explicit M-RoPE positions, logits kept only where an action token is predicted
  (``grpo/rollout/agent_rows.py``);
- ``rows_all_logits``: the same rows with logits over every position after the root, what a trainer that keeps the
  completion's logits computes (the ablation of "logits only at actions");
- ``per_step``: each turn a sample of its own with its whole history, only that turn's action trained, the layout of
  ZeroGUI and ms-swift's split mode (the peers' baseline).

G trajectories of T turns, one screenshot per turn (phone 1170x2532, desktop 1920x1080, tablet 800x1280, ...
cycling, each downscaled into image_min/max_pixels 64-256 x 28 x 28), actions of A random tokens ending in the stop
token. The ``small`` tiny Qwen2.5-VL (random weights), full fine-tuning, fp32, CPU. Each layout runs in its own
process; peak memory is the largest resident set during the passes minus the resident set before them (sampled every
2 ms); time is the median of the passes after the first. Layouts interleave over rounds; the best round is kept::

    .venv/bin/python benchmarks/bench_agent_step.py --generations 8 --turns 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

LAYOUTS = ("packed", "rows", "rows_all_logits", "per_step")
SCREENS = [(1170, 2532), (1920, 1080), (800, 1280), (1280, 800)]
MIN_PIXELS, MAX_PIXELS = 64 * 28 * 28, 256 * 28 * 28


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _renderer(model_dir: Path):
    import copy

    from llamafactory.data.template import TEMPLATES
    from llamafactory.extras.constants import IMAGE_PLACEHOLDER
    from transformers import AutoProcessor

    from llamafactory_qwenvl_patch.frame.families import resolve_family
    from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
    from llamafactory_qwenvl_patch.frame.video import VideoPolicy
    from llamafactory_qwenvl_patch.grpo.rollout.turns import TurnRenderer
    from llamafactory_qwenvl_patch.integration.plugin import pinned_plugin

    family = resolve_family(model_dir)
    policy = ResizePolicy(MIN_PIXELS, MAX_PIXELS, family.factor)
    template = copy.copy(TEMPLATES[family.default_template])
    video = VideoPolicy(2048, 12288, family.factor, 2.0, 16, family.video_clock)
    template.mm_plugin = pinned_plugin(template.mm_plugin, policy, video, 2.0)
    processor = AutoProcessor.from_pretrained(model_dir)
    return TurnRenderer(template, processor.tokenizer, processor, policy, IMAGE_PLACEHOLDER)


def _trajectories(r, generations: int, turns: int, action_tokens: int, seed: int):
    """(root, trajectories): G trajectories of ``turns`` random actions over screens of changing size."""
    import numpy as np
    from PIL import Image

    from llamafactory_qwenvl_patch.agent.frame import model_screen
    from llamafactory_qwenvl_patch.grpo.rollout.types import Segment, Trajectory

    rng = np.random.default_rng(seed)
    shots = [model_screen(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), r.policy).image
             for w, h in (SCREENS[t % len(SCREENS)] for t in range(turns))]
    prompt = [{"role": "user", "content": "Open the settings and turn on dark mode."}]
    root = r.root(prompt, shots[0], "Screen 1.")
    observations = [r.observation(prompt, t + 1, shots[t], f"Screen {t + 1}.") for t in range(1, turns)]
    vocab = r.tokenizer.vocab_size
    out = []
    for _ in range(generations):
        trajectory = Trajectory()
        for t in range(turns):
            if t:
                trajectory = trajectory.extended(observations[t - 1])
            action = tuple(int(x) for x in rng.integers(100, min(vocab, 400), action_tokens - 1)) + (r.stop_id,)
            trajectory = trajectory.extended(Segment("model", action))
        out.append(trajectory)
    return root, out


def _rows(root, trajectories, layout: str):
    """(ids, loss mask, images) per row of ``layout``."""
    rows = []
    for trajectory in trajectories:
        ids, mask = trajectory.rows()
        full = (list(root.ids) + ids, [0] * len(root.ids) + mask, [*root.images, *trajectory.images])
        if layout != "per_step":
            rows.append(full)
            continue
        end, images = len(root.ids), len(root.images)  # one row per turn: history, then that turn's action only
        for segment in trajectory.segments:
            end += len(segment.ids)
            images += len(segment.images)
            if segment.kind == "model":
                start = end - len(segment.ids)
                rows.append((full[0][:end], [0] * start + [1] * len(segment.ids), full[2][:images]))
    return rows


def worker(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    from llamafactory_qwenvl_patch.frame.mrope import pin_pretrained_positions
    from llamafactory_qwenvl_patch.grpo.rollout import shared_prefix
    from llamafactory_qwenvl_patch.grpo.rollout.agent_rows import (ACTION_INDEX, packed_trajectory_inputs,
                                                                    trajectory_inputs)
    from llamafactory_qwenvl_patch.grpo.trainer.step import StepMixin
    from types import SimpleNamespace

    torch.manual_seed(0)
    model_dir = Path(spec["model"])
    r = _renderer(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    pin_pretrained_positions(model)
    model.train()
    root, trajectories = _trajectories(r, spec["generations"], spec["turns"], spec["action_tokens"], 0)
    rows = _rows(root, trajectories, spec["layout"])
    context = contextlib.nullcontext
    if spec["layout"] == "packed":
        shared_prefix.install(model)
        members = [(*t.rows(), list(t.images)) for t in trajectories]
        inputs, targets, mask, _ = packed_trajectory_inputs(model, [(list(root.ids), list(root.images), members)],
                                                            r.processor.image_processor, r.tokenizer.pad_token_id,
                                                            len(trajectories))
        context = partial(shared_prefix.attention_active, [model])
    else:
        inputs, targets, mask = trajectory_inputs(model, rows, r.processor.image_processor, r.tokenizer.pad_token_id)
    if spec["layout"] == "rows_all_logits":  # every position after the root: the completion's logits
        width = inputs["input_ids"].size(1)
        index = torch.arange(width - max(len(ids) for ids, _, _ in rows) + len(root.ids) - 1, width - 1)
        keep = torch.zeros(len(rows), width, dtype=torch.long)
        for b, (ids, m, _) in enumerate(rows):
            keep[b, width - len(ids):] = torch.tensor(m)
        inputs[ACTION_INDEX], targets = index, inputs["input_ids"][:, index + 1]
        mask = keep[:, index + 1]
        targets = torch.where(mask.bool(), targets, torch.full_like(targets, r.tokenizer.pad_token_id))
    trainer = SimpleNamespace(suppressed=[], temperature=1.0)
    peak, base, stop = [0], _rss(), [False]

    def sample() -> None:
        while not stop[0]:
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    times = []
    for _ in range(spec["passes"]):
        start = time.perf_counter()
        with context():
            logps = StepMixin._token_logps(trainer, model, inputs, targets)[0]
            (-(logps * mask).sum() / mask.sum()).backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    stop[0] = True
    thread.join()
    layout = inputs.get(shared_prefix.KWARG)
    kept = layout.keep.numel() if layout is not None else int(inputs[ACTION_INDEX].numel()) * len(rows)
    return {"layout": spec["layout"], "rows": inputs["input_ids"].size(0),
            "row_tokens": int(inputs["attention_mask"].sum()), "kept_logits": kept, "action_tokens": int(mask.sum()),
            "pass_s": round(statistics.median(times[1:] or times), 3), "peak_mib": round((peak[0] - base) / 2**20, 1)}


def run_worker(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    if proc.returncode:
        raise RuntimeError(f"{spec['layout']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--action-tokens", type=int, default=32)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", "qwen2_5_vl", size="small")
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for layout in args.layouts.split(","):
                spec = dict(model=str(model), layout=layout, generations=args.generations, turns=args.turns,
                            action_tokens=args.action_tokens, passes=args.passes)
                result = run_worker(spec)
                if layout not in best or result["pass_s"] < best[layout]["pass_s"]:
                    best[layout] = result
        base = best.get("packed")
        for layout, result in best.items():
            if base is not None:
                result["time_vs_packed"] = round(result["pass_s"] / base["pass_s"], 2)
                result["memory_vs_packed"] = (round(result["peak_mib"] / base["peak_mib"], 2) if base["peak_mib"]
                                              else None)
            print(json.dumps(result))


if __name__ == "__main__":
    main()
