"""docs/figures/shared_prefix.png: a GRPO step's time and peak memory against the group size G, the shared prefix
(default) against the repeated layout (``grpo_shared_prefix: false``), from ``benchmarks/bench_grpo.py`` (tiny
Qwen2.5-VL, grounding prompts with one image, CPU). The benchmark's JSON is kept beside the figure, so the figure
can be redrawn without rerunning it::

    .venv/bin/python docs/figures/shared_prefix.py            # runs the benchmark (minutes), then draws
    .venv/bin/python docs/figures/shared_prefix.py --redraw   # draws from docs/figures/shared_prefix.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "benchmarks" / "bench_grpo.py"
GENERATIONS = (2, 4, 8, 16)
CONFIGS = {"shared": "shared prefix (default)", "repeated": "repeated layout"}


def measure() -> dict:
    out = subprocess.run([sys.executable, str(BENCH), "--shape", "grounding", "--configs", ",".join(CONFIGS),
                          "--generations", ",".join(map(str, GENERATIONS))], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out[out.index("{"):])


def draw(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
    for config, label in CONFIGS.items():
        rows = [(g, result["results"][f"{config} G{g}"]) for g in GENERATIONS if f"{config} G{g}" in result["results"]]
        time_ax.plot([g for g, _ in rows], [r["step_s"] for _, r in rows], marker="o", label=label)
        memory_ax.plot([g for g, _ in rows], [r["peak_mib"] for _, r in rows], marker="o", label=label)
    for ax, title in ((time_ax, "seconds per GRPO step"), (memory_ax, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(GENERATIONS, [str(g) for g in GENERATIONS])
        ax.set_xlabel("completions per prompt (G)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    time_ax.legend()
    fig.suptitle("Each prompt and its image once per group (tiny Qwen2.5-VL, CPU; benchmarks/bench_grpo.py)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redraw", action="store_true", help="draw from the kept JSON, without measuring")
    args = parser.parse_args()
    kept = HERE / "shared_prefix.json"
    if not args.redraw:
        kept.write_text(json.dumps(measure(), indent=1) + "\n")
    draw(json.loads(kept.read_text()), HERE / "shared_prefix.png")


if __name__ == "__main__":
    main()
