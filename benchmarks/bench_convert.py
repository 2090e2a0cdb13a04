"""Benchmark ``qwenvl-prep convert`` against header-only PIL reads of the same files, measured in one run.

Images: a pool of distinct JPEGs of mixed sizes (COCO-like, phone, screenshot, scan, random); each record gets its
own path (a hard link), so no cache keyed on paths helps convert. Peak memory: max RSS of the convert process for
10k and 100k records. "cli" times the whole ``qwenvl-prep convert`` process; "steady" times ``run_convert``
in-process after imports. The header-only
baseline is measured before and after, and averaged.

    .venv/bin/python benchmarks/bench_convert.py --records 100000 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

SIZES = [(640, 480), (640, 427), (4032, 3024), (3024, 4032), (1920, 1080), (1170, 2532), (2480, 3508), (800, 600)]


def make_pool(folder: Path, count: int) -> list[Path]:
    rng = random.Random(0)
    sizes = SIZES + [(rng.randint(64, 5000), rng.randint(64, 5000)) for _ in range(count - len(SIZES))]
    pool = []
    for i, (w, h) in enumerate(sizes):
        path = folder / f"pool{i}.jpg"
        Image.new("RGB", (w, h), (i % 255, 90, 160)).save(path, quality=30)
        pool.append(path)
    return pool


def make_dataset(folder: Path, pool: list[Path], records: int) -> Path:
    (folder / "img").mkdir(exist_ok=True)
    src = folder / f"in-{records}.jsonl"
    with open(src, "w") as f:
        for i in range(records):
            link = folder / "img" / f"{i:07d}.jpg"
            if not link.exists():
                os.link(pool[i % len(pool)], link)
            with Image.open(pool[i % len(pool)]) as im:
                w, h = im.size
            answer = json.dumps([{"bbox_2d": [w // 8, h // 8, w // 2, h // 2], "label": "thing"}])
            f.write(json.dumps({"image": f"img/{i:07d}.jpg", "question": "Where is the thing?", "answer": answer}) + "\n")
    return src


def header_rate(paths: list[Path]) -> float:
    start = time.perf_counter()
    for path in paths:
        with Image.open(path) as image:
            _ = image.size
    return len(paths) / (time.perf_counter() - start)


def run_convert(src: Path, out: Path, workers: int) -> tuple[float, float]:
    """(records/s, peak RSS MiB) of one ``qwenvl-prep convert`` subprocess."""
    cli = Path(sys.executable).parent / "qwenvl-prep"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    result = subprocess.run([str(cli), "convert", str(src), "-o", str(out), "--input-coords", "abs", "--min-pixels",
                             str(256 * 28 * 28), "--max-pixels", str(1280 * 28 * 28), "--workers", str(workers), "-q"],
                            capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(result.stderr[-2000:])
    records = json.loads(result.stdout)["written"]
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    return records / elapsed, peak


def in_process_rate(src: Path, out: Path, workers: int) -> float:
    """records/s of ``run_convert`` after imports: reading, converting and writing, without interpreter start-up."""
    from llamafactory_qwenvl_patch.frame.policy import load_backend
    from qwenvl_prep.pipeline.convert import ConvertOptions, run_convert
    from qwenvl_prep.lf.run_spec import spec_from_flags

    load_backend()

    opts = ConvertOptions(input=src, output=out, target=spec_from_flags(256 * 28 * 28, 1280 * 28 * 28,
                          "qwen2_5_vl").stamp, input_coords="abs", workers=workers, progress=False)
    start = time.perf_counter()
    written = run_convert(opts)["written"]
    return written / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--pool", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        pool = make_pool(folder, args.pool)
        small = make_dataset(folder, pool, args.small)
        large = make_dataset(folder, pool, args.records)
        paths = sorted((folder / "img").iterdir())[: args.records]
        header_rate(paths[:2000])  # warm the page cache for both contenders
        base = header_rate(paths)
        small_rate, small_rss = run_convert(small, folder / "out-small.jsonl", args.workers)
        large_rate, large_rss = run_convert(large, folder / "out-large.jsonl", args.workers)
        steady = in_process_rate(large, folder / "out-steady.jsonl", args.workers)
        base_after = header_rate(paths)
    base = (base + base_after) / 2
    per_core = large_rate / args.workers
    print(json.dumps({
        "records": args.records, "workers": args.workers,
        "header_only_images_per_s_one_core": round(base),
        "cli_records_per_s": round(large_rate), "cli_records_per_s_per_core": round(per_core),
        "cli_ratio_per_core_vs_header_only": round(per_core / base, 3),
        "steady_records_per_s": round(steady), "steady_ratio_per_core_vs_header_only":
            round(steady / args.workers / base, 3),
        f"peak_rss_mib_{args.small}": round(small_rss, 1), f"peak_rss_mib_{args.records}": round(large_rss, 1),
        "peak_rss_growth_mib": round(large_rss - small_rss, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
