"""GRPO learns: on the tiny model, a verifiable reward (say "cat") rises from ~0 to near 1 within 24 steps, for
two seeds; and a reward that starts near 1 (do not say "cat") falls when its weight is -1, so the sign of the
advantage is what drives the direction."""

from __future__ import annotations

import pytest
from helpers import grounding_record, read_log, run_cli, save_image, train_config, write_sharegpt

TARGET = ("def target(completions, **kw):\n    return [min(1.0, c.count('cat') / 3) for c in completions]\n"
          "def absent(completions, **kw):\n    return [1.0 - min(1.0, c.count('cat') / 3) for c in completions]\n")
STEPS = 24


@pytest.fixture(scope="module")
def task(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("learn")
    data = root / "data"
    write_sharegpt(data, "toy", [grounding_record(save_image(data / f"i{i}.jpg", 100 + 37 * i, 90 + 23 * i,
                                                             (20 * i, 100, 200))) for i in range(8)])
    (root / "target.py").write_text(TARGET)
    return root, data


def learn(task, tiny_model, reward: str, weight: str, seed: int) -> list[float]:
    root, data = task
    out = root / f"out-{reward}-{weight}-{seed}"
    config = train_config(
        tiny_model, data, out, stage="grpo", finetuning_type="full", max_steps=STEPS, save_steps=1000, seed=seed,
        image_min_pixels=4 * 28 * 28, image_max_pixels=16 * 28 * 28, per_device_train_batch_size=2,
        grpo_num_generations=8, max_new_tokens=8, temperature=1.0, grpo_beta=0.0, learning_rate=1e-2,
        lr_scheduler_type="constant", reward_funcs=f"{root / 'target.py'}:{reward}", reward_weights=weight)
    result = run_cli(["llamafactory-cli", "train"], config, root / f"run-{reward}-{weight}-{seed}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [row[f"rewards/{reward}/mean"] for row in read_log(out) if "loss" in row]


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.parametrize("seed", [0, 1])
def test_reward_rises(task, tiny_model, seed):
    curve = learn(task, tiny_model, "target", "1", seed)
    assert len(curve) == STEPS and curve[0] <= 0.1
    assert sum(curve[-4:]) / 4 >= 0.6, curve


@pytest.mark.slow
@pytest.mark.learning
def test_flipped_sign_drives_the_reward_down(task, tiny_model):
    curve = learn(task, tiny_model, "absent", "-1", 0)
    assert curve[0] >= 0.9
    assert sum(curve[-4:]) / 4 <= 0.4, curve
