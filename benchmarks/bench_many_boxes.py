"""Many-box evaluation time: one record with hundreds of true and thousands of predicted boxes through what
``qwenvl-prep eval`` computes for it (Hungarian matching at IoU 0.5, the order-free mAP at ten thresholds, the
detection hacks with their duplicate count), for the current code and, with ``--previous REV``, for that revision
(a git worktree, in its own process), in one run::

    .venv/bin/python benchmarks/bench_many_boxes.py --previous HEAD~1

Cases (issue 33, class 9, which measured the box-by-box code at 106 s, 183 s and a timeout): 400 true / 3,000
predicted boxes; 400 true / 3,000 predicted that are 10 copies of 300 boxes (duplicates); 400 true / 20,000 predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {"400x3000": (400, 3000, False), "400x3000-duplicates": (400, 3000, True), "400x20000": (400, 20000, False)}


def boxes(count: int, seed: int, duplicates: bool = False) -> list[tuple[float, float, float, float]]:
    rng = random.Random(seed)
    base = count // 10 if duplicates else count
    out = []
    for _ in range(base):
        x, y = rng.uniform(0, 950), rng.uniform(0, 950)
        out.append((x, y, x + rng.uniform(5, 50), y + rng.uniform(5, 50)))
    return (out * 10)[:count] if duplicates else out


def run_case(name: str) -> float:
    """Seconds for one case with the code importable in this process."""
    from llamafactory_qwenvl_patch.scoring.coco_map import coco_map
    from llamafactory_qwenvl_patch.scoring.detection import Detection, hacks, match_detections

    true_count, predicted_count, duplicates = CASES[name]
    truth = [Detection(b, "obj") for b in boxes(true_count, 0)]
    predicted = [Detection(b, "obj") for b in boxes(predicted_count, 1, duplicates)]
    start = time.perf_counter()
    match_detections(truth, predicted)
    coco_map([(truth, predicted, (1000, 1000))])
    hacks(truth, predicted, (1000.0, 1000.0))
    return time.perf_counter() - start


def measure(source: Path, name: str, timeout: float) -> float | None:
    env = {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{source / 'preprocessing'}"}
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", name], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=source)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--previous", help="a git revision to time beside the current code")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case before it counts as a timeout")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(run_case(args.worker))
        return
    results: dict[str, dict[str, float | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"current": ROOT}
        if args.previous:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", f"{tmp}/previous", args.previous],
                           check=True, capture_output=True)
            sources["previous"] = Path(tmp) / "previous"
        try:
            for name in args.cases.split(","):
                results[name] = {label: measure(source, name, args.timeout) for label, source in sources.items()}
                print(name, results[name], file=sys.stderr)
        finally:
            if args.previous:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", f"{tmp}/previous"],
                               capture_output=True)
    print(json.dumps({"seconds (None: over --timeout)": results}, indent=2))


if __name__ == "__main__":
    main()
