"""``qwenvl-prep convert`` stopped by a signal (issues 11 and 33): SIGTERM leaves no temp file and a later run
removes a dead run's, workers orphaned by SIGKILL end quietly, and the worker pool always stops."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import BIN, save_image
from hostile import POLICY, RECORD, run_convert


def convert_mid_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A `convert` CLI process with 2 workers, well inside its conversion of 400,000 records (past its temp file's
    creation), and its output folder."""
    import time

    save_image(tmp_path / "ok.jpg", 640, 480)
    src = tmp_path / "in.jsonl"
    src.write_text((json.dumps(RECORD) + "\n") * 400000)  # several seconds of work, so a signal lands mid-run
    data = tmp_path / "data"
    data.mkdir()
    process = subprocess.Popen([str(BIN / "qwenvl-prep"), "convert", str(src), "-o", str(data / "train.json"),
                                "--input-coords", "abs", "-q", "--workers", "2", "--min-pixels",
                                str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(data.glob(".train.json.*.tmp")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert process.poll() is None, "convert finished before it could be interrupted; give it more records"
    return process, data


def test_sigterm_leaves_no_temp_file_and_a_later_run_removes_stale_ones(tmp_path):
    """Class 8: after SIGTERM a hidden temp file stayed in the dataset folder and workers printed BrokenPipe
    tracebacks; after SIGKILL nothing can clean up, so temp names carry the PID and the next run removes those of
    dead processes."""
    import signal

    process, data = convert_mid_run(tmp_path)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]
    assert sorted(p.name for p in data.iterdir()) == []
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = data / f".train.json.{dead.pid}.abc123.tmp"
    stale.write_text("half a file")
    mine = data / f".train.json.{os.getpid()}.def456.tmp"  # a live process's temp file is never touched
    mine.write_text("in progress")
    code, _ = run_convert(tmp_path, [RECORD], "--input-coords", "abs")
    assert code == 0 and not stale.exists() and mine.exists()


def test_orphaned_workers_end_quietly(tmp_path):
    """Item 9: after the parent convert was killed with SIGKILL, its workers printed BrokenPipeError tracebacks."""
    import signal

    process, _ = convert_mid_run(tmp_path)
    process.send_signal(signal.SIGKILL)
    _, err = process.communicate(timeout=120)  # EOF only once every worker holding the pipe has ended
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]


@pytest.mark.slow
def test_the_pool_always_stops(tmp_path):
    """Issue 33, class 11, the stress the issue asks for: 40 converts of three chunks on 2 workers under load (two
    at a time), each either left to finish or sent SIGTERM at a random moment; every one ends within a minute,
    with rc 0 and its output or stopped by the signal and no half-written file."""
    import random
    import signal
    import time

    save_image(tmp_path / "ok.jpg", 640, 480)
    src = tmp_path / "in.jsonl"
    src.write_text((json.dumps(RECORD) + "\n") * 3000)
    rng = random.Random(0)
    outcomes = []
    for pair in range(20):
        running = []
        for slot in range(2):
            out = tmp_path / f"run{pair}-{slot}"
            process = subprocess.Popen([str(BIN / "qwenvl-prep"), "convert", str(src), "-o", str(out / "t.json"),
                                        "--input-coords", "abs", "-q", "--workers", "2", "--min-pixels",
                                        str(POLICY.min_pixels), "--max-pixels", str(POLICY.max_pixels)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env={**os.environ, "PYTHONFAULTHANDLER": "1"})
            running.append((process, out, rng.random() < 0.75, rng.uniform(0.2, 2.5)))
        start = time.monotonic()
        for process, out, kill, delay in sorted(running, key=lambda item: item[3]):
            if kill:
                time.sleep(max(0.0, start + delay - time.monotonic()))
                process.send_signal(signal.SIGTERM)
        for process, out, kill, _ in running:
            try:
                _, err = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # seen once in about 300 runs under load (2026-12-05): SIGABRT makes
                process.send_signal(signal.SIGABRT)  # the fault handler print where each thread waits
                try:
                    _, err = process.communicate(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    _, err = process.communicate()
                raise AssertionError(f"convert {out} did not end within 60 s (signalled: {kill}); its threads:\n"
                                     f"{err[-6000:]}") from None
            stopped = (128 + signal.SIGTERM, -signal.SIGTERM)  # -15: the signal came before the CLI's handler
            assert process.returncode in ((0, *stopped) if kill else (0,)), err[-2000:]
            assert "Traceback" not in err, err[-2000:]
            files = sorted(p.name for p in out.iterdir() if p.name != ".dataset_info.json.lock") if out.exists() else []
            assert not any(name.endswith(".tmp") for name in files), files  # nothing half-written
            if process.returncode == 0:
                assert files == ["dataset_info.json", "t.json"] and len(json.loads((out / "t.json").read_text())) == 3000
            outcomes.append(process.returncode)
    assert 0 in outcomes and 128 + signal.SIGTERM in outcomes  # both paths taken, the pool's unwinding among them
