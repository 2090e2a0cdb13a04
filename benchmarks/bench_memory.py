"""Peak memory of ``qwenvl-prep`` commands that must stream: small vs 10x larger input, in one run.

    .venv/bin/python benchmarks/bench_memory.py [--small 20000]

- ``eval``: a converted grounding dataset and its predictions, ``--small`` vs 10x records.
- ``convert`` where every record is bad (a missing image): ``--small`` vs 10x records; the error report is streamed.
- ``draw --sample 0``: 4 vs 40 phone-size images (4032x3024); only thumbnails are kept for the contact sheet.

Each command runs in its own helper process, which reports the peak RSS of its one child (``RUSAGE_CHILDREN``).
Flat memory means the larger run's peak is close to the smaller one's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

BIN = Path(sys.executable).parent
MEASURE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
           "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
FLAGS = ["--min-pixels", str(256 * 28 * 28), "--max-pixels", str(1280 * 28 * 28)]


def peak_mib(*command: str) -> float:
    out = subprocess.run([sys.executable, "-c", MEASURE, *command], check=True, capture_output=True, text=True)
    return int(out.stdout.strip()) / 1024


def write_lines(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def eval_case(folder: Path, records: int) -> float:
    Image.new("RGB", (1920, 1080), (90, 140, 200)).save(folder / "img.jpg")
    raw = write_lines(folder / f"raw{records}.jsonl", ({"image": "img.jpg", "question": "Where?",
                                                        "answer": '[{"bbox_2d": [100, 100, 500, 400]}]'}
                                                       for _ in range(records)))
    data = folder / "data" / f"eval{records}.jsonl"
    subprocess.run([str(BIN / "qwenvl-prep"), "convert", str(raw), "-o", str(data), "--input-coords", "abs", "-q",
                    *FLAGS], check=True, stdout=subprocess.DEVNULL)
    predictions = write_lines(folder / f"pred{records}.jsonl", ({"predict": '[{"bbox_2d": [50, 40, 200, 180]}]'}
                                                                for _ in range(records)))
    return peak_mib(str(BIN / "qwenvl-prep"), "eval", str(data), "--predictions", str(predictions), "--json")


def bad_convert_case(folder: Path, records: int) -> float:
    raw = write_lines(folder / f"bad{records}.jsonl", ({"image": f"missing{i}.jpg", "question": "Where?",
                                                        "answer": '[{"bbox_2d": [1, 1, 5, 5]}]'}
                                                       for i in range(records)))
    command = [str(BIN / "qwenvl-prep"), "convert", str(raw), "-o", str(folder / "out" / f"bad{records}.jsonl"),
               "--input-coords", "abs", "-q", "--skip-bad", "--workers", "1", *FLAGS]
    out = subprocess.run([sys.executable, "-c", MEASURE.replace("check=True", "check=False"), *command],
                         check=True, capture_output=True, text=True)
    return int(out.stdout.strip()) / 1024


def draw_case(folder: Path, images: int) -> float:
    sub = folder / f"draw{images}"
    sub.mkdir()
    rng = np.random.default_rng(0)
    photo = Image.fromarray((rng.random((3024, 4032, 3)) * 255).astype(np.uint8))
    for i in range(images):
        photo.save(sub / f"p{i}.jpg", quality=80)
    raw = write_lines(sub / "raw.jsonl", ({"image": f"p{i}.jpg", "question": "Where?",
                                          "answer": '[{"bbox_2d": [100, 100, 2000, 1500]}]'} for i in range(images)))
    data = sub / "data" / "d.jsonl"
    subprocess.run([str(BIN / "qwenvl-prep"), "convert", str(raw), "-o", str(data), "--input-coords", "abs", "-q",
                    *FLAGS], check=True, stdout=subprocess.DEVNULL)
    return peak_mib(str(BIN / "qwenvl-prep"), "draw", str(data), "-o", str(sub / "drawn"), "--sample", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=20000)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, case, sizes in (("eval", eval_case, (args.small, 10 * args.small)),
                                  ("convert_all_bad", bad_convert_case, (args.small, 10 * args.small)),
                                  ("draw_sample_0", draw_case, (4, 40))):
            small, large = (case(root, size) for size in sizes)
            results[name] = {"sizes": list(sizes), "peak_rss_mib": [round(small, 1), round(large, 1)],
                             "large_over_small": round(large / small, 2)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
