"""Issue 22, items 12-15: an interrupted GRPO run resumes as the same run.

A run with rollout reuse (``grpo_num_iterations: 2``, ``grpo_steps_per_generation: 2``: each rollout serves 4
optimiser steps) is killed with SIGKILL inside a reuse window (by its own reward, at the second rollout: after
checkpoint 3 was written and step 4 logged); checkpoints cut short by a kill are planted above the last complete one;
LF's automatic resume then relaunches it. It must skip the incomplete checkpoints, resume from checkpoint 3 with the
stored rollout, log each step once, and end with the uninterrupted run's metrics, completions and adapter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import grounding_record, read_log, run_cli, save_image, train_config, write_sharegpt

REWARDS = '''
import os
import signal
import zlib

CALLS = 0


def spread_or_die(completions, **kw):
    """Scores that differ between completions; SIGKILLs its own process at rollout GRPO_TEST_KILL_AT_ROLLOUT."""
    global CALLS
    CALLS += 1
    if CALLS == int(os.environ.get("GRPO_TEST_KILL_AT_ROLLOUT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    return [(zlib.crc32(c.encode()) % 100) / 100 for c in completions]
'''
TIMING = ("elapsed_time", "remaining_time", "throughput")


def config(tiny_model: Path, data_dir: Path, out: Path, rewards: Path) -> dict:
    return train_config(tiny_model, data_dir, out, stage="grpo", image_min_pixels=64 * 28 * 28,
                        image_max_pixels=256 * 28 * 28, max_steps=6, save_steps=3, grpo_num_generations=4,
                        max_new_tokens=8, temperature=1.0, learning_rate=5e-2, grpo_epsilon=0.02,
                        grpo_num_iterations=2, grpo_steps_per_generation=2, grpo_log_completions=True,
                        reward_funcs=f"format,{rewards}:spread_or_die")


def steps(out: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in read_log(out) if "loss" in row]


def completions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


def adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model) -> dict[str, Path]:
    """The uninterrupted run, and the same run killed in a reuse window and relaunched over planted incomplete
    checkpoints; the relaunch's output is returned with it."""
    root = tmp_path_factory.mktemp("grpo-resume")
    data_dir = root / "data"
    write_sharegpt(data_dir, "toy", [grounding_record(save_image(data_dir / f"g{i}.jpg", *size))
                                     for i, size in enumerate([(640, 480), (480, 640), (800, 600), (300, 300)])])
    rewards = root / "rewards.py"
    rewards.write_text(REWARDS)
    whole, killed = root / "whole", root / "killed"
    result = run_cli(["llamafactory-cli", "train"], config(tiny_model, data_dir, whole, rewards), root / "whole-run")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    result = run_cli(["llamafactory-cli", "train"], config(tiny_model, data_dir, killed, rewards), root / "kill-run",
                     env={"GRPO_TEST_KILL_AT_ROLLOUT": "2"})
    assert result.returncode == -9, (result.stdout + result.stderr)[-4000:]
    assert [row["current_steps"] for row in steps(killed)] == [1, 2, 3, 4]
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-3"]
    # what kills during checkpoint writes leave behind, above the last complete checkpoint
    partial = killed / "checkpoint-4"
    partial.mkdir()
    shutil.copy(killed / "checkpoint-3" / "adapter_model.safetensors", partial)  # weights, no trainer_state.json
    shutil.copytree(killed / "checkpoint-3", killed / "checkpoint-5")  # all but the processor, and no marker
    (killed / "checkpoint-5" / "processor_config.json").write_bytes(b"")
    for marker in (killed / "checkpoint-5").glob("qwenvl_checkpoint*"):
        marker.unlink()
    (killed / "checkpoint-7").mkdir()  # empty
    result = run_cli(["llamafactory-cli", "train"], config(tiny_model, data_dir, killed, rewards), root / "resume-run")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return {"whole": whole, "resumed": killed, "output": output}


@pytest.mark.slow
def test_incomplete_checkpoints_are_skipped_with_a_warning(runs):
    """Item 13: LF's automatic resume picked checkpoint-7 (empty) and every relaunch crashed."""
    for name in ("checkpoint-7", "checkpoint-5", "checkpoint-4"):
        assert f"skipping {runs['resumed'] / name}" in runs["output"]
    assert f"from {runs['resumed'] / 'checkpoint-3'}" in runs["output"]


@pytest.mark.slow
def test_a_run_killed_inside_a_reuse_window_resumes_as_the_same_run(runs):
    """Item 12: the resumed run sampled a new rollout at step 4 instead of reusing the stored one (stale log-probs
    and clipping gone, every later rollout shifted: final adapter off by 0.0245 against lora_B values of 0.035).
    Item 14: the rows after the checkpoint were logged twice."""
    import torch

    whole, resumed = steps(runs["whole"]), steps(runs["resumed"])
    assert [row["current_steps"] for row in resumed] == [1, 2, 3, 4, 5, 6]
    assert resumed == whole
    assert [row["current_steps"] for row in resumed if "reward" in row] == [1, 5]  # two rollouts, no extra one
    assert whole[3]["clip_ratio"] > 0  # step 4 optimises the stored rollout again: clipping acts
    assert completions(runs["resumed"]) == completions(runs["whole"])
    expected, got = adapter(runs["whole"]), adapter(runs["resumed"])
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    moved = adapter(runs["whole"] / "checkpoint-3")
    assert any(not torch.equal(expected[name], moved[name]) for name in expected)  # steps 4-6 changed the weights


def test_completeness_rules(tmp_path):
    """Which checkpoint a relaunch resumes from: with markers, the marker (and the sizes it lists) decide; a run
    written before markers existed is judged by its files; a log line cut short by a kill is dropped."""
    from llamafactory_qwenvl_patch.grpo.trainer.resume import (
        checkpoint_problem,
        last_complete,
        mark_complete,
        trim_jsonl,
    )

    def checkpoint(step: int, state: bool = True, empty: str | None = None) -> Path:
        folder = tmp_path / "run" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"weights")
        if state:
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        if empty:
            (folder / empty).write_bytes(b"")
        return folder

    checkpoint(2), checkpoint(4, empty="processor_config.json"), checkpoint(6, state=False)
    best, skipped = last_complete(tmp_path / "run")  # no markers anywhere: the files decide
    assert best.endswith("checkpoint-2") and [(Path(f).name, why) for f, why in skipped] == [
        ("checkpoint-6", "no readable trainer_state.json"), ("checkpoint-4", "processor_config.json is empty")]
    mark_complete(tmp_path / "run" / "checkpoint-2", 2)
    marked = checkpoint(8)
    mark_complete(marked, 8)
    (marked / "adapter_model.safetensors").write_bytes(b"cut")  # changed after its marker was written
    best, skipped = last_complete(tmp_path / "run")
    assert best.endswith("checkpoint-2") and [Path(f).name for f, _ in skipped] == [
        "checkpoint-8", "checkpoint-6", "checkpoint-4"]
    assert "adapter_model.safetensors is missing or has another size" in checkpoint_problem(marked)
    assert "no complete-marker" in checkpoint_problem(tmp_path / "run" / "checkpoint-4")
    from types import SimpleNamespace

    from llamafactory_qwenvl_patch.integration.grpo_workflow import grpo_resume_point

    warnings: list[str] = []
    logger = SimpleNamespace(warning_rank0=warnings.append)
    args = SimpleNamespace(resume_from_checkpoint=str(marked), output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="resume_from_checkpoint .*checkpoint-8 cannot be resumed from"):
        grpo_resume_point(args, True, logger)  # named in the YAML: an error, never a silent substitute
    assert grpo_resume_point(args, False, logger).endswith("checkpoint-2") and len(warnings) == 4  # picked by LF
    log = tmp_path / "trainer_log.jsonl"
    log.write_text("".join(json.dumps({"current_steps": s}) + "\n" for s in range(1, 6)) + '{"current_st')
    assert trim_jsonl(log, lambda row: row["current_steps"] <= 3) == 3
    assert [json.loads(line)["current_steps"] for line in log.read_text().splitlines()] == [1, 2, 3]


def test_a_checkpoint_changed_since_its_marker_is_refused_by_name(tmp_path):
    """Issue 33, class 8: flipped bytes in the adapter keep its size, and a resumed run carried them on (a weight went
    from 0.12 to 2392). The marker records each file's sha256; the checkpoint a run resumes from is hashed again and
    a changed file is refused by name, whether LF picked the checkpoint or the YAML named it."""
    from types import SimpleNamespace

    from llamafactory_qwenvl_patch.grpo.trainer.resume import (
        MARKER,
        ChangedCheckpointError,
        last_complete,
        mark_complete,
    )
    from llamafactory_qwenvl_patch.integration.grpo_workflow import grpo_resume_point

    run = tmp_path / "run"
    for step in (2, 4):
        folder = run / f"checkpoint-{step}"
        (folder / "sub").mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 64)
        (folder / "sub" / "optimizer.pt").write_bytes(b"state" * 10)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        mark_complete(folder, step)
    latest = run / "checkpoint-4"
    logger = SimpleNamespace(warning_rank0=lambda message: None)
    assert grpo_resume_point(SimpleNamespace(resume_from_checkpoint=str(latest), output_dir=str(run)), False,
                         logger) == str(latest)  # intact: resumed, verified
    data = bytearray((latest / "adapter_model.safetensors").read_bytes())
    data[1000] ^= 0x40  # one flipped bit, same size
    (latest / "adapter_model.safetensors").write_bytes(bytes(data))
    assert last_complete(run)[0] == str(latest)  # complete by its sizes: only the checksum tells
    for explicit in (False, True):
        args = SimpleNamespace(resume_from_checkpoint=str(latest), output_dir=str(run))
        with pytest.raises(ChangedCheckpointError, match=r"checkpoint-4/adapter_model\.safetensors changed since"):
            grpo_resume_point(args, explicit, logger)
    data[1000] ^= 0x40
    (latest / "adapter_model.safetensors").write_bytes(bytes(data))  # the original bytes back
    (latest / "sub" / "optimizer.pt").write_bytes(b"STATE" * 10)  # a file in a sub-folder is listed too
    with pytest.raises(ChangedCheckpointError, match=r"sub/optimizer\.pt"):
        grpo_resume_point(SimpleNamespace(resume_from_checkpoint=str(latest), output_dir=str(run)), True, logger)
    old = run / "checkpoint-2"  # a marker written before checksums (sizes only) is still honoured, unverified
    marker = json.loads((old / MARKER).read_text())
    marker["files"] = {name: entry["size"] for name, entry in marker["files"].items()}
    (old / MARKER).write_text(json.dumps(marker))
    (old / "trainer_state.json").write_text(json.dumps({"global_step": 3}))  # same size, not caught: no checksum
    assert grpo_resume_point(SimpleNamespace(resume_from_checkpoint=str(old), output_dir=str(run)), True,
                         logger) == str(old)
    for files in (["adapter_model.safetensors"], {"../../x": {"size": 1, "sha256": "0"}}, {"a": {"size": "1"}}):
        (old / MARKER).write_text(json.dumps({"global_step": 2, "files": files}))  # a marker that lies or is garbage
        with pytest.raises(ValueError, match="no complete-marker"):
            grpo_resume_point(SimpleNamespace(resume_from_checkpoint=str(old), output_dir=str(run)), True, logger)
