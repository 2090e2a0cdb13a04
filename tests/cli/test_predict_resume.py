"""``qwenvl-prep predict -o`` resumes (issue 43, item 3): a run stopped by SIGKILL or SIGTERM continues from its
last whole batch when started again and ends with the output of a run that was never stopped (sampling at a
temperature, so each batch's seed matters); a batch cut by the kill is answered again, whole; other settings are
refused by name; a second run into the same output is refused while the first writes."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import save_image

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record

RECORDS, BATCH = 24, 2


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    model = root / "model"
    shutil.copytree(tiny_model, model)
    write_policy_record(model, ResizePolicy(16 * 28 * 28, 64 * 28 * 28))
    images = [str(save_image(root / f"i{k}.jpg", 320 + 8 * k, 240)) for k in range(RECORDS)]
    return root, model, images


def command(setup, out: Path, *extra: str) -> list[str]:
    root, model, images = setup
    qwenvl_prep = Path(sys.executable).parent / "qwenvl-prep"  # the environment running the tests
    return [str(qwenvl_prep), "predict", str(model), *images, "--prompt", "Where is the cat?", "-o", str(out),
            "--batch-size", str(BATCH), "--max-new-tokens", "24", "--temperature", "1.0", "--seed", "5", *extra]


def run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)


def stopped(args: list[str], partial: Path, sig: int) -> None:
    """Start the run and send ``sig`` once its partial output holds at least two batches."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and partial.read_bytes().count(b"\n") >= 2 * BATCH:
            proc.send_signal(sig)
            break
        time.sleep(0.05)
    proc.wait(timeout=120)
    assert proc.returncode != 0, "the run finished before it could be stopped"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_a_stopped_run_continues_to_the_uninterrupted_output(setup, tmp_path, sig):
    whole = tmp_path / "whole.jsonl"
    assert run(command(setup, whole)).returncode == 0
    out = tmp_path / "stopped.jsonl"
    partial = out.with_name(out.name + ".partial")
    stopped(command(setup, out), partial, sig)
    assert not out.exists() and partial.exists()  # never a final file that is not whole
    done = partial.read_bytes()
    assert done.count(b"\n") < RECORDS and done.count(b"\n") % BATCH == 0
    with open(partial, "ab") as f:  # what a kill in the middle of a batch's write leaves: a whole row, half a row
        f.write(done.splitlines(keepends=True)[0] + b'{"image": "half a ro')
    result = run(command(setup, out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.read_text() == whole.read_text() and not partial.exists()
    assert out.read_bytes().startswith(done)
    settings = json.loads(out.with_name(out.name + ".settings.json").read_text())
    assert settings["settings"]["seed"] == 5 and settings["jobs"]["count"] == RECORDS


@pytest.mark.slow
def test_other_settings_or_a_second_writer_are_refused(setup, tmp_path):
    out = tmp_path / "p.jsonl"
    partial = out.with_name(out.name + ".partial")
    stopped(command(setup, out), partial, signal.SIGKILL)
    kept = partial.read_bytes()
    result = run(command(setup, out)[:-2] + ["--seed", "6"])
    assert result.returncode == 2 and "settings.seed differ" in result.stderr and "delete both" in result.stderr
    with open(partial, "ab") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = run(command(setup, out))
    assert result.returncode == 2 and "another run is writing" in result.stderr
    assert partial.read_bytes() == kept  # neither refused run touched it


def test_a_resumed_output_keeps_whole_batches_only(tmp_path):
    """A batch cut anywhere (after whole rows of it, or inside a row) is dropped, so the relaunch answers it again
    at its own index and seed rather than continuing in the middle of it."""
    from qwenvl_prep.plumbing.resumable import ResumableOutput

    out = tmp_path / "p.jsonl"
    with pytest.raises(KeyboardInterrupt), ResumableOutput(out, {"a": 1}, batch=3) as first:
        first.append([{"row": k} for k in range(3)])
        first.append([{"row": k} for k in range(3, 6)])
        raise KeyboardInterrupt
    partial = out.with_name(out.name + ".partial")
    whole = partial.read_bytes()
    with open(partial, "ab") as f:
        f.write(b'{"row": 6}\n{"row": 7}\n{"ro')
    with ResumableOutput(out, {"a": 1}, batch=3) as again:
        assert again.done == 6 and partial.read_bytes() == whole
        again.append([{"row": k, "text": "a\u2028b\x85c"} for k in range(6, 9)])  # line breaks only str knows
        assert [row["row"] for row in again.rows()] == list(range(9))
    assert [row["row"] for row in map(json.loads, out.read_bytes().split(b"\n")[:-1])] == list(range(9))
