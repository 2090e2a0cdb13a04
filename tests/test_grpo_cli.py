"""``llamafactory-cli train`` with ``stage: grpo`` on the tiny model (CPU): LoRA, resume, no reference, full
fine-tuning with a frozen reference, and ZeRO-3 on 2 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import grounding_record, read_log, run_cli, save_image, train_config, write_sharegpt

REWARDS = '''
import zlib


def one(completions, **kw):
    return [1.0] * len(completions)


def boom(completions, **kw):
    raise RuntimeError("a user bug")


def spread(completions, *, references, orig_sizes, model_sizes, policy, indices, coords):
    assert len(references) == len(orig_sizes) == len(model_sizes) == len(indices) == len(completions)
    assert all(m[0] % policy.factor == 0 for m in model_sizes) and coords == "model"
    return [(zlib.crc32(c.encode()) % 100) / 100 for c in completions]


def spread_rel1000(completions, *, model_sizes, policy, coords, **kw):
    assert coords == "rel1000" and policy.factor == 32 and all(m[0] % 32 == 0 for m in model_sizes)
    return [(zlib.crc32(c.encode()) % 100) / 100 for c in completions]
'''
CONFIG = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("grpo")
    data_dir = root / "data"
    sizes = [(640, 480), (1920, 1080), (333, 777), (1024, 768)]
    write_sharegpt(data_dir, "toy", [grounding_record(save_image(data_dir / f"g{i}.jpg", *s)) for i, s in
                                     enumerate(sizes)])
    (root / "my_rewards.py").write_text(REWARDS)
    return root, data_dir


def grpo_config(tiny_model, data_dir, out, rewards_file, **overrides):
    settings = dict(stage="grpo", image_min_pixels=64 * 28 * 28, image_max_pixels=256 * 28 * 28, max_steps=3,
                    save_steps=3, grpo_num_generations=4, max_new_tokens=12, temperature=1.0, plot_loss=True,
                    reward_funcs=f"iou,format,{rewards_file}:spread")
    return train_config(tiny_model, data_dir, out, **{**settings, **overrides})


METRICS = ["loss", "reward", "reward_std", "frac_reward_zero_std", "kl", "clip_ratio", "completion_length/mean",
           "completion_length/max", "parse_failures", "rewards/iou/mean", "rewards/format/std"]


@pytest.fixture(scope="module")
def lora_run(setup, tiny_model):
    root, data_dir = setup
    out = root / "lora"
    config = grpo_config(tiny_model, data_dir, out, root / "my_rewards.py", grpo_log_completions=True,
                         reward_funcs=f"iou,format,{root / 'my_rewards.py'}:one,{root / 'my_rewards.py'}:boom",
                         reward_weights="1,1,0.5,1")
    result = run_cli(["llamafactory-cli", "train"], config, root / "lora-run")
    assert result.returncode == 0, result.stderr[-4000:]
    return root, out, config


@pytest.mark.slow
def test_lora_grpo_logs_metrics_weights_and_errors(lora_run):
    _, out, _ = lora_run
    steps = [row for row in read_log(out) if "loss" in row]
    assert [row["current_steps"] for row in steps] == [1, 2, 3]
    for row in steps:
        assert all(name in row for name in METRICS), sorted(row)
        assert row["reward"] == pytest.approx(0.5)  # 0 (iou) + 0 (format) + 0.5 * 1 (one) + 0 (boom raised)
        assert row["rewards/boom/errors"] == 4  # every completion of the step, counted, training went on
    assert (out / "checkpoint-3" / "adapter_model.safetensors").exists()
    assert json.loads((out / "checkpoint-3" / "preprocessor_config.json").read_text())["size"]["longest_edge"] == \
        256 * 28 * 28
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {"prompt", "completion", "reward", "reference", "index"} <= set(rows[0])
    assert "Locate the box" in rows[0]["prompt"] and "bbox_2d" in rows[0]["reference"]
    assert (out / "training_reward.png").exists()


@pytest.mark.slow
def test_resume_continues_the_step_count(lora_run):
    root, out, config = lora_run
    resumed = {**config, "max_steps": 5, "save_steps": 5, "resume_from_checkpoint": str(out / "checkpoint-3")}
    result = run_cli(["llamafactory-cli", "train"], resumed, root / "resume-run")
    assert result.returncode == 0, result.stderr[-4000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 5
    assert [row["step"] for row in state["log_history"] if "loss" in row][-2:] == [4, 5]


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_full_finetuning_reference(setup, tiny_model, beta):
    root, data_dir = setup
    out = root / f"full-{beta}"
    config = grpo_config(tiny_model, data_dir, out, root / "my_rewards.py", finetuning_type="full", grpo_beta=beta,
                         max_steps=2, save_steps=2, learning_rate=1e-3)
    result = run_cli(["llamafactory-cli", "train"], config, root / f"full-run-{beta}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    created = "Created reference model from the model itself." in output
    assert created == (beta != 0)
    steps = [row for row in read_log(out) if "loss" in row]
    assert len(steps) == 2
    if beta == 0:
        assert all(row["kl"] == 0 for row in steps)
    else:
        assert steps[1]["kl"] > 0  # the policy moved away from its frozen copy after one update
    assert (out / "model.safetensors").exists()


@pytest.mark.slow
def test_zero3_two_ranks(setup, tiny_model):
    root, data_dir = setup
    out = root / "z3"
    config = grpo_config(tiny_model, data_dir, out, root / "my_rewards.py", deepspeed=str(CONFIG / "ds_z3_cpu_test.json"),
                         ddp_backend="gloo", use_cpu=None, grpo_scale_rewards="batch")
    result = run_cli(["llamafactory-cli", "train"], config, root / "z3-run",
                     env={"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2", "MASTER_PORT": "29541"}, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    steps = [row for row in read_log(out) if "loss" in row]
    assert len(steps) == 3 and steps[-1]["kl"] > 0
    assert (out / "checkpoint-3" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_qwen3_vl_grpo(setup, tiny_model_qwen3):
    """Qwen3-VL: factor 32, 0-1000 coordinates, and the token types its M-RoPE needs in transformers 5.x."""
    root, data_dir = setup
    out = root / "qwen3"
    config = grpo_config(tiny_model_qwen3, data_dir, out, root / "my_rewards.py", template="qwen3_vl_nothink",
                         image_min_pixels=64 * 32 * 32, image_max_pixels=256 * 32 * 32, max_steps=2, save_steps=2,
                         reward_funcs=f"format,{root / 'my_rewards.py'}:spread_rel1000")
    result = run_cli(["llamafactory-cli", "train"], config, root / "qwen3-run")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    steps = [row for row in read_log(out) if "loss" in row]
    assert len(steps) == 2 and steps[0]["rewards/spread_rel1000/errors"] == 0 and steps[0]["reward_std"] > 0
