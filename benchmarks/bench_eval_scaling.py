"""``qwenvl-prep eval`` time against the size of its predictions file: one-box records at each of ``--sizes``, the
middle size with one hostile answer of 100,000 boxes in place of a record's, and ``--at-bound`` records whose answers
hold the most boxes allowed (``scoring.answers.MAX_ANSWER_ITEMS``), each run as the CLI in its own process::

    .venv/bin/python benchmarks/bench_eval_scaling.py [--sizes 100,400,1600] [--at-bound 3]

Linear means the seconds per 1,000 records stay flat as the file grows, and the hostile answer adds next to
nothing. One record is converted; each dataset repeats it under its own registry entry (the same stamp). Start-up
(imports, the first record) is timed apart, as eval of that one record, and taken off every run's time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

BIN = Path(sys.executable).parent
FLAGS = ["--min-pixels", str(256 * 28 * 28), "--max-pixels", str(1280 * 28 * 28)]
ANSWER = '[{"bbox_2d": [50, 40, 200, 180]}]'


def timed(*command: str) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def dataset(folder: Path, records: int) -> Path:
    """A converted dataset of ``records`` copies of one record, registered as ``d{records}``."""
    data = folder / "data"
    if not (data / "d1.jsonl").exists():
        Image.new("RGB", (1920, 1080), (90, 140, 200)).save(folder / "img.jpg")
        (folder / "raw.jsonl").write_text(json.dumps({"image": str(folder / "img.jpg"), "question": "Where?",
                                                      "answer": '[{"bbox_2d": [100, 100, 500, 400]}]'}) + "\n")
        subprocess.run([str(BIN / "qwenvl-prep"), "convert", str(folder / "raw.jsonl"), "-o", str(data / "d1.jsonl"),
                        "--input-coords", "abs", "-q", *FLAGS], check=True, stdout=subprocess.DEVNULL)
    line = (data / "d1.jsonl").read_text()
    (data / f"d{records}.jsonl").write_text(line * records)
    info = json.loads((data / "dataset_info.json").read_text())
    info[f"d{records}"] = {**info["d1"], "file_name": f"d{records}.jsonl"}
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data / f"d{records}.jsonl"


def predictions(path: Path, answers: list[str]) -> Path:
    path.write_text("".join(json.dumps({"predict": text}) + "\n" for text in answers))
    return path


def row(name: str, records: int, preds: Path, seconds: float, startup: float) -> str:
    work = max(seconds - startup, 0.0)
    return (f"| {name} | {records:,} | {preds.stat().st_size / 1e6:.2f} | {work:.2f} | "
            f"{work / records * 1000:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,400,1600", help="records of the one-box files")
    parser.add_argument("--at-bound", type=int, default=3, help="records whose answers hold the most boxes allowed")
    args = parser.parse_args()
    from llamafactory_qwenvl_patch.scoring.answers import MAX_ANSWER_ITEMS

    eval_cli = [str(BIN / "qwenvl-prep"), "eval"]
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        one = predictions(folder / "p1.jsonl", [ANSWER])
        startup = timed(*eval_cli, str(dataset(folder, 1)), "--predictions", str(one))
        sizes = [int(n) for n in args.sizes.split(",")]
        for records in sizes:
            data = dataset(folder, records)
            preds = predictions(folder / f"p{records}.jsonl", [ANSWER] * records)
            rows.append(row("one-box answers", records, preds,
                            timed(*eval_cli, str(data), "--predictions", str(preds)), startup))
        records = sizes[len(sizes) // 2]
        data = dataset(folder, records)
        hostile = json.dumps([{"bbox_2d": [k % 900, 10, 950, 960]} for k in range(100_000)])
        preds = predictions(folder / "hostile.jsonl", [hostile] + [ANSWER] * (records - 1))
        rows.append(row("one-box answers, one of them 100,000 boxes", records, preds,
                        timed(*eval_cli, str(data), "--predictions", str(preds)), startup))
        data = dataset(folder, args.at_bound)
        dense = json.dumps([{"bbox_2d": [k % 900, k % 500, k % 900 + 60, k % 500 + 60]}
                            for k in range(MAX_ANSWER_ITEMS)])
        preds = predictions(folder / "bound.jsonl", [dense] * args.at_bound)
        rows.append(row(f"answers of {MAX_ANSWER_ITEMS:,} boxes each (the bound)", args.at_bound, preds,
                        timed(*eval_cli, str(data), "--predictions", str(preds)), startup))
    print(f"start-up (eval of one record): {startup:.2f} s, taken off each time below")
    print("| predictions | records | MB | s | s per 1k records |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
