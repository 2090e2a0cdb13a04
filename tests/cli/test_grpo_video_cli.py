"""``llamafactory-cli train`` with ``stage: grpo`` on video prompts: the hybrid Qwen3.5 with the shared prefix, and a
small Qwen3-VL with vLLM rollouts (the in-process equivalence of the layouts is tests/unit/grpo/test_grpo_video.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import write_clip

pytestmark = pytest.mark.slow  # llamafactory-cli runs


REWARDS = '''
import zlib


def spread(completions, *, model_sizes, orig_sizes, resize_policy, **kw):
    """Rewards see each video prompt's frame: the clip's size and the frame the model saw."""
    assert all(m is not None and m[0] % resize_policy.factor == 0 for m in model_sizes), model_sizes
    assert all(o is not None for o in orig_sizes), orig_sizes
    return [(zlib.crc32(c.encode()) % 100) / 100 for c in completions]
'''


def video_dataset(tmp_path: Path) -> Path:
    """Four span-answer video records and the reward that checks each prompt's frame."""
    import json

    from helpers import write_sharegpt

    data = tmp_path / "data"
    data.mkdir()
    records = []
    for i, (seconds, width, height) in enumerate([(2, 96, 64), (3, 64, 96), (1.5, 80, 80), (2.5, 128, 72)]):
        write_clip(data / f"v{i}.mp4", seconds, 10, width, height)
        records.append({"messages": [{"role": "user", "content": "<video>When does the bar reach the right edge?"},
                                     {"role": "assistant", "content": json.dumps({"span": [0.5, seconds]})}],
                        "videos": [f"v{i}.mp4"]})
    write_sharegpt(data, "toy", records, {"messages": "messages", "videos": "videos"})
    (tmp_path / "r.py").write_text(REWARDS)
    return data


def video_grpo_run(model: Path, template: str, tmp_path: Path, **overrides: Any) -> tuple[list[dict], Path, str]:
    """``llamafactory-cli train`` with ``stage: grpo`` on ``video_dataset``: (logged steps, output folder, log)."""
    from helpers import read_log, run_cli, train_config

    data = video_dataset(tmp_path)
    out = tmp_path / "out"
    config = train_config(model, data, out, stage="grpo", template=template, max_steps=2,
                          save_steps=2, grpo_num_generations=3, max_new_tokens=8, temperature=1.0,
                          reward_funcs=f"format,{tmp_path / 'r.py'}:spread", video_min_pixels=2048,
                          video_max_pixels=12288, video_maxlen=16, per_device_train_batch_size=2, **overrides)
    result = run_cli(["llamafactory-cli", "train"], config, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [entry for entry in read_log(out) if "reward" in entry]
    assert len(steps) == 2 and all(entry["rewards/spread/errors"] == 0 for entry in steps)
    return steps, out, result.stdout + result.stderr


def test_grpo_cli_on_video_prompts(tiny_model_qwen3_5, tmp_path):
    """``llamafactory-cli train`` with ``stage: grpo`` on a video dataset (the hybrid Qwen3.5, shared prefix on by
    default): it trains, rewards get each prompt's frame, and the checkpoint carries the video policy."""
    import json

    _, out, log = video_grpo_run(tiny_model_qwen3_5, "qwen3_5_nothink", tmp_path)
    assert "grpo_shared_prefix: on" in log
    record = json.loads((out / "qwenvl_policy.json").read_text())
    assert record["video"] == {"min_pixels": 2048, "max_pixels": 12288, "factor": 32, "fps": 2.0, "max_frames": 16,
                               "clock": "stamps", "frame_list_fps": 2.0}  # frame lists: video_fps, as LF assumes


@pytest.mark.vllm
def test_grpo_cli_on_video_prompts_with_vllm_rollouts(small_model_qwen3, tmp_path):
    """The same run with ``grpo_rollout_backend: vllm`` on a ``--size small`` Qwen3-VL: vLLM samples each video
    prompt from the frames the plugin decoded for the loss, in the training clock (the engine checks grids, pads
    and stamps on every batch), and its log-probs are the training model's."""
    pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
    steps, _, _ = video_grpo_run(small_model_qwen3, "qwen3_vl_nothink", tmp_path, grpo_rollout_backend="vllm")
    assert all(entry["vllm/logp_diff/mean"] < 1e-3 for entry in steps)
