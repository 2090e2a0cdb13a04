"""Issue 41, items 2, 3, 4 and 10: one output_dir holds one run, and a run only ever resumes a complete checkpoint
of the same kind of run.

- Item 2: with ``save_total_limit: 1`` transformers deleted checkpoint-1 before checkpoint-2's complete-marker was
  written, so a kill in between left no complete checkpoint (or an unmarked one was resumed by the rule for runs
  written before markers).
- Item 3: two runs started into one ``output_dir`` both trained, interleaving their logs and checkpoints.
- Item 4: a run into another run's ``output_dir`` resumed its checkpoints without comparing them (another frame or
  family silently; another LoRA rank or model size as a torch ``size mismatch``), and an adapter of another family
  trained without a word.
- Item 10: SFT checkpoints had no complete-marker: one cut short blocked every relaunch.

The checks on what a run resumes call LF's real ``get_train_args`` in this process (where they all happen, before
any model loads) on copies of one tiny SFT run; two CLI starts show the refusals as a user meets them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import grounding_record, read_log, run_cli, save_image, train_config, write_sharegpt

from llamafactory_qwenvl_patch.grpo.trainer.resume import MARKER, RUN_FILE, last_complete, mark_complete, rotate

HOLD = """
import sys, time
from llamafactory_qwenvl_patch.integration.run_lock import lock_output_dir
lock_output_dir(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def hold_lock(output_dir: Path) -> subprocess.Popen:
    """Another process that holds ``output_dir``'s run lock until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(output_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def checkpoint(run: Path, step: int, marked: bool) -> Path:
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"weights" * step)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if marked:
        mark_complete(folder, step)
    return folder


def test_a_locked_output_dir_is_refused_by_name_and_freed_when_its_holder_dies(tmp_path):
    """Item 3: the lock names the folder, the holder's pid and host; a SIGKILLed holder leaves it free."""
    from llamafactory_qwenvl_patch.integration.run_lock import RunLockedError, lock_output_dir

    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        with pytest.raises(RunLockedError) as refused:
            lock_output_dir(out)
        message = str(refused.value)
        assert str(out) in message and f"pid {holder.pid}" in message and socket.gethostname() in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock_output_dir(out)
    lock_output_dir(out)  # the same process may train into it again, one run after the other


FORKING_HOLDER = """
import multiprocessing, sys, time
from llamafactory_qwenvl_patch.integration.run_lock import lock_output_dir
lock_output_dir(sys.argv[1])
worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))  # as a dataloader worker
worker.start()
print(worker.pid, flush=True)
time.sleep(600)
"""


def test_deleting_the_lock_file_does_not_free_the_folder(tmp_path):
    """Issue 51, class 10: the lock was the file's. Deleting ``.qwenvl_run.lock`` under a live run let a second
    run lock a new file and train into the folder to the end, the two runs' steps interleaved."""
    from llamafactory_qwenvl_patch.integration.run_lock import LOCK_FILE, RunLockedError, lock_output_dir

    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        (out / LOCK_FILE).unlink()
        with pytest.raises(RunLockedError) as refused:
            lock_output_dir(out)
        assert "was deleted" in str(refused.value) and str(out) in str(refused.value), refused.value
        assert not (out / LOCK_FILE).exists()  # the refused run left no file that would name nobody
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock_output_dir(out)


@pytest.mark.parametrize("how", ["deleted", "moved away"])
def test_a_run_whose_folder_was_replaced_stops_at_its_next_step(tmp_path, how):
    """Issue 51, class 10: the lock is the folder's inode. A folder deleted (or moved away) under a live run let a
    second run lock the new folder of that name while the first went on writing into it by path; the first now
    stops at its next step's end, before its log line or checkpoint lands there."""
    import shutil
    from types import SimpleNamespace

    from llamafactory_qwenvl_patch.integration.checkpoint_guard import OutputDirStillLocked
    from llamafactory_qwenvl_patch.integration.run_lock import RunLockedError, lock_output_dir

    out = tmp_path / "out"
    lock_output_dir(out)
    step_end = OutputDirStillLocked().on_step_end
    step_end(SimpleNamespace(output_dir=str(out)), None, None)  # still its folder: nothing happens
    if how == "deleted":
        shutil.rmtree(out)
    else:
        out.rename(tmp_path / "kept")
    newcomer = hold_lock(out)
    try:
        with pytest.raises(RunLockedError, match="was deleted or replaced while this run trained into it"):
            step_end(SimpleNamespace(output_dir=str(out)), None, None)
        with pytest.raises(RunLockedError, match="is in use by another run"):
            lock_output_dir(out)  # this process again (a notebook's next run): the new folder is the newcomer's
    finally:
        newcomer.send_signal(signal.SIGKILL)
        newcomer.wait()
    lock_output_dir(out)  # once free, this process locks the new folder, and its steps go on
    step_end(SimpleNamespace(output_dir=str(out)), None, None)


def test_a_forked_worker_does_not_keep_a_killed_run_s_lock(tmp_path):
    """Issue 51, class 10: a fork shares flock locks, so dataloader workers of a SIGKILLed run held its folder
    until they noticed their parent was gone. The run's forked children close the lock's descriptors."""
    from llamafactory_qwenvl_patch.integration.run_lock import RunLockedError, lock_output_dir

    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    worker = int(run.stdout.readline())
    try:
        run.send_signal(signal.SIGKILL)
        run.wait()
        os.kill(worker, 0)  # the worker lives on
        deadline = time.monotonic() + 10  # the child drops the lock in its at-fork hook, which a loaded machine runs late
        while True:
            try:
                lock_output_dir(out)
                break
            except RunLockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        os.kill(worker, signal.SIGKILL)


def rotate_as_the_trainer_does(run: Path, limit: int) -> None:
    """The rotation transformers runs inside ``Trainer._save_checkpoint``, before any on_save callback (a module
    function since transformers 5, a Trainer method in 4.x)."""
    import llamafactory.train.tuner  # noqa: F401 - loading LF's tuner applies the plugin's patches
    import transformers.trainer as trainer_module

    if hasattr(trainer_module, "rotate_checkpoints"):
        trainer_module.rotate_checkpoints(output_dir=str(run), save_total_limit=limit, use_mtime=True)
        return
    import torch
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(str(run), save_total_limit=limit, use_cpu=True, report_to=[])
    Trainer(model=torch.nn.Linear(2, 2), args=args)._rotate_checkpoints(use_mtime=True, output_dir=str(run))


def test_rotation_never_deletes_the_last_complete_checkpoint_before_the_next_is_complete(tmp_path):
    """Item 2: transformers deleted checkpoint-1 while checkpoint-2 was still being written (no marker yet)."""
    run = tmp_path / "run"
    checkpoint(run, 1, marked=True)
    second = checkpoint(run, 2, marked=False)  # written, its marker not yet
    rotate_as_the_trainer_does(run, limit=1)
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-1", "checkpoint-2"]
    mark_complete(second, 2)
    rotate(run, limit=1)  # what runs once the marker is written
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-2"]
    checkpoint(run, 3, marked=True), checkpoint(run, 4, marked=True)
    rotate(run, limit=1, best=str(run / "checkpoint-2"))  # the best checkpoint is kept, as transformers does
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-2", "checkpoint-4"]


def test_a_marking_run_never_resumes_an_unmarked_checkpoint(tmp_path):
    """Item 2: with checkpoint-1 rotated away and checkpoint-2 cut short before its marker, no checkpoint had a
    marker and checkpoint-2 was resumed by the rule for runs written before markers."""
    run = tmp_path / "run"
    checkpoint(run, 2, marked=False)
    assert last_complete(run)[0] == str(run / "checkpoint-2")  # a run from before markers: its files decide
    (run / RUN_FILE).write_text(json.dumps({"identity": {"stage": "sft"}}))  # a run that writes markers
    best, skipped = last_complete(run)
    assert best is None and skipped == [(str(run / "checkpoint-2"), f"no complete-marker {MARKER} (written last)")]


# --- on a real tiny SFT run ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model) -> dict:
    """One tiny LoRA SFT run, two steps, a checkpoint at each, ``save_total_limit: 1``."""
    root = tmp_path_factory.mktemp("run-safety")
    data_dir = root / "data"
    write_sharegpt(data_dir, "toy", [grounding_record(save_image(data_dir / f"s{i}.jpg", 640, 480)) for i in range(2)])
    config = train_config(tiny_model, data_dir, root / "out", save_steps=1, max_steps=2, save_total_limit=1)
    result = run_cli(["llamafactory-cli", "train"], config, root / "first")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return {"out": root / "out", "config": config, "yaml": root / "first" / "run.yaml"}


def copy_run(sft_run: dict, tmp_path: Path) -> tuple[Path, dict]:
    out = tmp_path / "out"
    shutil.copytree(sft_run["out"], out, ignore=shutil.ignore_patterns(".qwenvl_run.lock"))
    return out, {**sft_run["config"], "output_dir": str(out)}


def train_args(config: dict, logged: list[str] | None = None):
    """LF's own argument parsing for a training run, in this process: everything the plugin decides before the model
    loads (what LF's loggers say then goes to ``logged``)."""
    from llamafactory.hparams import get_train_args

    from llamafactory_qwenvl_patch.integration.run_guard import training_run

    handler = logging.Handler()
    handler.emit = lambda record: (logged if logged is not None else []).append(record.getMessage())
    logging.getLogger("llamafactory").addHandler(handler)
    try:
        with training_run():  # as LF's training function parses them (a parse elsewhere writes nothing)
            return get_train_args(dict(config))
    finally:
        logging.getLogger("llamafactory").removeHandler(handler)


@pytest.mark.slow
def test_sft_checkpoints_are_marked_and_rotated_only_after_the_marker(sft_run):
    """Items 10 and 2: each SFT checkpoint gets the complete-marker, written after the processor's files, and
    ``save_total_limit: 1`` removes checkpoint-1 only once checkpoint-2 is complete."""
    out = sft_run["out"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    marker = json.loads((out / "checkpoint-2" / MARKER).read_text())
    assert {"qwenvl_policy.json", "adapter_model.safetensors", "trainer_state.json", "optimizer.pt"} <= set(
        marker["files"])
    assert marker["run"]["finetuning_type"] == "lora" and marker["run"]["image_max_pixels"] == 512 * 28 * 28
    assert [row["current_steps"] for row in read_log(out) if "loss" in row] == [1, 2]


@pytest.mark.slow
def test_sft_resumes_from_the_last_complete_checkpoint(sft_run, tmp_path, monkeypatch):
    """Item 10: LF resumed the highest-numbered checkpoint, cut short or not (`Can't find a valid checkpoint`,
    `FileNotFoundError: trainer_state.json`) on every relaunch."""
    out, config = copy_run(sft_run, tmp_path)
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-3", ignore=shutil.ignore_patterns(MARKER))
    (out / "checkpoint-3" / "trainer_state.json").unlink()  # the disk filled up before it was written
    (out / "checkpoint-4").mkdir()
    logged: list[str] = []
    assert train_args(config, logged)[2].resume_from_checkpoint == str(out / "checkpoint-2")
    for name in ("checkpoint-4", "checkpoint-3"):
        assert any(line.startswith(f"skipping {out / name}: ") for line in logged), logged
    assert not [line for line in logged if "launched with other settings" in line]  # the same launch resumes
    # issue 51: a YAML relaunched into an output_dir another run has since taken continued it without a word
    logged = []
    train_args({**config, "learning_rate": 3.0e-4, "seed": 7}, logged)
    other = [line for line in logged if "launched with other settings" in line]
    assert len(other) == 1 and other[0].startswith(f"resuming {out / 'checkpoint-2'}, which a run"), logged
    assert "learning_rate: 0.0001 there, 0.0003 here; seed: 42 there, 7 here" in other[0], other
    # the same keys from another run's YAML file: the file itself tells the launches apart
    relaunched = tmp_path / "another-run.yaml"
    relaunched.write_text(json.dumps(config))
    monkeypatch.setattr(sys, "argv", ["llamafactory-cli", str(relaunched)])
    logged = []
    train_args(config, logged)
    other = [line for line in logged if "launched with other settings" in line]
    assert len(other) == 1 and f"config: {sft_run['yaml']} (sha256 " in other[0], logged
    assert f"there, {relaunched} (sha256 " in other[0], other
    monkeypatch.undo()
    with pytest.raises(ValueError, match="resume_from_checkpoint .*checkpoint-3 cannot be resumed from"):
        train_args({**config, "resume_from_checkpoint": str(out / "checkpoint-3")})
    (out / "checkpoint-2" / MARKER).unlink()  # item 2: the only checkpoint left was killed before its marker
    assert train_args(config)[2].resume_from_checkpoint is None


@pytest.mark.slow
def test_a_resume_is_compared_with_the_run_before_the_model_loads(sft_run, tmp_path, small_model, tiny_model_qwen3):
    """Item 4: another frame or family resumed silently; another LoRA rank or model size ended in a torch `size
    mismatch`, full fine-tuning on LoRA checkpoints in `Can't find a checkpoint index`."""
    from llamafactory_qwenvl_patch.integration.run_identity import RunMismatchError

    out, config = copy_run(sft_run, tmp_path)
    cases = {"image_max_pixels": ({"image_max_pixels": 128 * 28 * 28}, "401408", "100352"),
             "lora_rank": ({"lora_rank": 16}, "8", "16"),
             "finetuning_type": ({"finetuning_type": "full"}, "lora", "full"),
             "model": ({"model_name_or_path": str(small_model)}, "hidden_size 64", "hidden_size 128"),
             "family": ({"model_name_or_path": str(tiny_model_qwen3), "template": "qwen3_vl_nothink"},
                        "qwen2_5_vl", "qwen3_vl")}
    for key, (change, there, here) in cases.items():
        with pytest.raises(RunMismatchError) as refused:
            train_args({**config, **change})
        message = str(refused.value)
        assert str(out / "checkpoint-2") in message and key in message and there in message and here in message, (
            key, message)
    # a checkpoint written before identities were recorded is compared by its files
    marker = json.loads((out / "checkpoint-2" / MARKER).read_text())
    (out / "checkpoint-2" / MARKER).write_text(json.dumps({k: v for k, v in marker.items() if k != "run"}))
    (out / RUN_FILE).unlink()
    for key in ("image_max_pixels", "lora_rank", "finetuning_type", "model"):
        with pytest.raises(RunMismatchError, match=key):
            train_args({**config, **cases[key][0]})
    assert train_args(config)[2].resume_from_checkpoint == str(out / "checkpoint-2")  # the same run resumes


@pytest.mark.slow
def test_an_adapter_of_another_family_is_refused(sft_run, tmp_path, tiny_model_qwen3):
    """Item 4: a Qwen2.5-VL SFT adapter (absolute pixels) trained on under a Qwen3-VL GRPO run (0-1000)."""
    from llamafactory_qwenvl_patch.integration.run_identity import RunMismatchError

    config = train_config(tiny_model_qwen3, tmp_path, tmp_path / "grpo", stage="grpo", template="qwen3_vl_nothink",
                          adapter_name_or_path=str(sft_run["out"]), reward_funcs="format")
    with pytest.raises(RunMismatchError) as refused:
        train_args(config)
    message = str(refused.value)
    assert str(sft_run["out"]) in message and "qwen2_5_vl" in message and "qwen3_vl" in message
    assert "absolute pixels" in message and "0-1000" in message


@pytest.mark.slow
def test_the_cli_refuses_a_busy_output_dir_and_another_run_s_checkpoints(sft_run, tmp_path):
    """Items 3 and 4 as a user meets them: one message naming what to change, before any model loads."""
    out, config = copy_run(sft_run, tmp_path)
    before = (out / "trainer_log.jsonl").read_text()
    holder = hold_lock(out)
    try:
        result = run_cli(["llamafactory-cli", "train"], config, tmp_path / "second")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    output = result.stdout + result.stderr
    assert result.returncode != 0 and f"output_dir {out} is in use by another run" in output, output[-3000:]
    assert f"pid {holder.pid} on {socket.gethostname()}" in output
    assert (out / "trainer_log.jsonl").read_text() == before
    result = run_cli(["llamafactory-cli", "train"], {**config, "image_max_pixels": 128 * 28 * 28}, tmp_path / "third")
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "RunMismatchError" in output and "image_max_pixels" in output, output[-3000:]
    assert "trainable params" not in output  # refused before the model loaded
    assert (out / "trainer_log.jsonl").read_text() == before
    assert os.path.isfile(out / "checkpoint-2" / MARKER)
