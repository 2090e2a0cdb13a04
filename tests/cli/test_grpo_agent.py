"""``llamafactory-cli train`` with ``stage: grpo`` and ``grpo_agent_env``: multi-turn rollouts from a stock YAML (HF
generation on a tiny Qwen2.5-VL, vLLM on small Qwen2.5-VL, Qwen3-VL and Qwen3.5), against the shipped simulator
(screens that change size every turn) and an environment written outside the project; the trajectories logged with
every turn's sizes and mapped action; an environment that fails every trajectory stops the run naming it; keys
refused before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import failure_report, read_log, run_cli, run_ranks, train_config, write_sharegpt

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import POLICY_FILE
from qwenvl_prep.cli import main

MIN, MAX = 64 * 28 * 28, 256 * 28 * 28
SIM = "qwenvl_prep.demos.gui_env:ClickThroughEnv"
ZERO3 = Path(__file__).resolve().parents[2] / "configs" / "ds_z3_cpu_test.json"
OUTSIDE_ENV = '''
from PIL import Image

from llamafactory_qwenvl_patch.agent import Observation, Step


class ColourScreens:
    """Written outside the project: a screen of another size every turn; an answer holding "e" passes it."""

    def __init__(self, screens=2):
        self.screens = screens

    def reset(self, task, seed):
        self.turn = 0
        return self._observe()

    def _observe(self):
        size = [(900, 1600), (1600, 900), (777, 333)][self.turn % 3]
        return Observation(Image.new("RGB", size, (40 * self.turn, 90, 160)), f"screen {self.turn + 1}")

    def step(self, action):
        passed = "e" in action.raw
        self.turn += passed
        done = self.turn == self.screens
        return Step(self._observe(), 1.0 if done else 0.0, done, {"state_key": self.turn})

    def close(self):
        pass
'''


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    data = root / "data"
    records = [{"messages": [{"role": "user", "content": "Press the control each screen names, one per turn."},
                             {"role": "assistant", "content": '{"action": "done"}'}],
                "meta": {"id": f"task{i}", "screens": 2, "platform": platform}}
               for i, platform in enumerate(["phone", "desktop", "laptop", "tablet"])]
    write_sharegpt(data, "tasks", records, columns={"messages": "messages"})
    (root / "envs").mkdir()
    (root / "envs" / "colour_env.py").write_text(OUTSIDE_ENV)
    return root, data


def agent_config(model_dir, data, out, template, **overrides):
    settings = dict(stage="grpo", dataset="tasks", template=template, image_min_pixels=MIN, image_max_pixels=MAX,
                    max_steps=2, save_steps=2, grpo_num_generations=4, max_new_tokens=8, temperature=1.0,
                    reward_funcs="env,action_format", reward_weights="1.0,0.1",
                    grpo_agent_env=SIM,
                    grpo_agent_env_kwargs='{"reader": "raw", "change_size": true}', grpo_agent_max_turns=3,
                    grpo_agent_max_tokens=4096)
    return train_config(model_dir, data, out, **{**settings, **overrides})


def check_run(out, factor: int) -> list[dict]:
    """What every agent run here must show (its trainer log rows returned): an adapter at the end; two logged steps
    with the agent metrics; a task per step (batch 1), G 4 trajectories each; every logged turn's model frame the
    policy's frame of that turn's screenshot, the screenshots of a trajectory changing size, and every action either
    mapped into that screenshot's pixels or invalid with a reason."""
    assert (out / "adapter_model.safetensors").is_file()
    logged = [row for row in read_log(out) if "loss" in row]
    assert len(logged) == 2
    for row in logged:
        assert 1 <= row["agent/turns/mean"] <= 3
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4
    check_trajectories(logged, rows, factor, ("done", "turns", "context"))
    assert max(len(row["trajectory"]["turns"]) for row in rows) >= 2  # later turns were sampled too
    return logged


def check_trajectories(logged: list[dict], rows: list[dict], factor: int, ends: tuple[str, ...]) -> None:
    """What every agent run's log and trajectories show: the agent metrics on every logged step; each completion the
    turns' texts; every turn's model frame the policy's frame of that turn's screenshot, the screenshots changing
    size (the simulator's ``change_size``), and every action either mapped into that screenshot's pixels or invalid
    with a reason."""
    for row in logged:
        assert 0 <= row["agent/done_rate"] <= 1 and "agent/trie_saving" in row
        assert "rewards/env/mean" in row and "rewards/action_format/mean" in row
    policy = ResizePolicy(MIN, MAX, factor)
    sizes = set()
    for row in rows:
        turns = row["trajectory"]["turns"]
        assert row["completion"] == "\n".join(turn["text"] for turn in turns)
        assert row["trajectory"]["end"] in ends
        for turn in turns:
            orig_hw = tuple(turn["orig_hw"])
            sizes.add(orig_hw)
            assert tuple(turn["model_hw"]) == policy.model_size(*orig_hw)
            action = turn["action"]
            if action["kind"] == "invalid":
                assert action["reason"]
            elif "x" in action:
                assert 0 <= action["x"] <= orig_hw[1] and 0 <= action["y"] <= orig_hw[0]
    assert len(sizes) >= 2  # the simulator changes size mid-episode


@pytest.mark.slow
def test_an_agent_trains_from_a_stock_yaml(tiny_model, tasks, tmp_path, capsys):
    """Two steps of G 4 over two tasks, three turns at most, rolled out by HF generation (``check_run``), then one
    greedy trajectory per task evaluated by the trainer, then by ``agent-eval`` on the run's adapter folder. Qwen3-VL
    and Qwen3.5 train from the same YAML on vLLM rollouts below; their HF generation over turns (explicit positions
    after turn 1) is checked in process by tests/unit/grpo/test_agent_rollout.py and test_agent_turns.py."""
    _, data = tasks
    out = tmp_path / "out"
    result = run_cli(["llamafactory-cli", "train"],
                     agent_config(tiny_model, data, out, "qwen2_vl", do_eval=True, eval_dataset="tasks",
                                  per_device_eval_batch_size=2), tmp_path, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    check_run(out, 28)
    metrics = json.loads((out / "eval_results.json").read_text())
    assert {"eval_reward", "eval_agent/done_rate", "eval_agent/turns", "eval_rewards/env"} <= set(metrics)
    # agent-eval takes the run's LoRA adapter folder as it is (its base loaded, the adapter merged in memory, the
    # run's frame): every turn in that frame, the same trajectories as the adapter merged and saved as a whole folder
    merged = tmp_path / "merged"
    _merge_adapter(tiny_model, out, merged)
    rows = {}
    for name, folder in (("adapter", out), ("merged", merged)):
        result_file = tmp_path / f"{name}.jsonl"
        code = main(["agent-eval", str(folder), "--env", SIM, "--env-kwargs", '{"reader": "raw", "change_size": true}',
                     "--tasks", "2", "--max-turns", "3", "--max-new-tokens", "8", "--isolation", "inline",
                     "--bootstrap", "10", "-o", str(result_file)])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert json.loads(captured.out)["trajectories"] == 2
        rows[name] = [json.loads(line) for line in result_file.read_text().splitlines()]
    policy = ResizePolicy(MIN, MAX, 28)
    assert [row["turns"] for row in rows["adapter"]] == [row["turns"] for row in rows["merged"]]
    for row in rows["adapter"]:
        for turn in row["turns"]:
            w, h = turn["orig_size"]
            assert turn["model_size"] == list(reversed(policy.model_size(h, w)))


def _merge_adapter(base, adapter, merged):
    """``adapter`` merged into ``base`` by peft and saved with the adapter folder's processor and frame record."""
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(merged)
    AutoProcessor.from_pretrained(adapter).save_pretrained(merged)
    shutil.copy(adapter / POLICY_FILE, merged / POLICY_FILE)


@pytest.mark.slow
def test_the_shared_task_prefix_trains_as_one_row_per_trajectory(tiny_model, tasks, tmp_path):
    """Two tasks a step, accumulation 2, G 4, up to three turns on screens that change size: the same seed with the
    shared prefix (on by default: each task's root once, its trajectories packed behind it) and without (one row
    per trajectory; each task's first turn sampled G times from one prefill of its root, or from G rows) give the same
    rewards and trajectories, the same loss and KL, and adapters within 1e-5 (SGD, so
    the adapters compare the gradients)."""
    from safetensors.torch import load_file

    _, data = tasks
    logs, adapters, completions = {}, {}, {}
    for shared in ("auto", "false"):
        out = tmp_path / shared
        config = agent_config(tiny_model, data, out, "qwen2_vl", per_device_train_batch_size=2,
                              gradient_accumulation_steps=2, optim="sgd", learning_rate=0.1, grpo_shared_prefix=shared)
        result = run_cli(["llamafactory-cli", "train"], config, tmp_path / f"run-{shared}", timeout=1200)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-4000:]
        assert ("grpo_shared_prefix: on" in output) == (shared == "auto")
        logs[shared] = [row for row in read_log(out) if "loss" in row]
        adapters[shared] = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
        completions[shared] = [json.loads(line)["completion"] for line in
                               (out / "completions.jsonl").read_text().splitlines()]
    assert completions["auto"] == completions["false"] and len(completions["auto"]) == 2 * 2 * 2 * 4
    assert len(logs["auto"]) == len(logs["false"]) == 2
    for ours, theirs in zip(logs["auto"], logs["false"]):
        assert ours["reward"] == theirs["reward"] and ours["agent/turns/mean"] == theirs["agent/turns/mean"]
        assert ours["agent/shared_roots"] == 2 and "agent/shared_roots" not in theirs  # sampled from one prefill
        for key in ("loss", "kl", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    moved = 0
    for name, tensor in adapters["false"].items():
        assert (adapters["auto"][name] - tensor).abs().max() <= 1e-5, name
        moved += bool(tensor.abs().max() > 1e-4 and "lora_B" in name)
    assert moved > 0


def uneven_tasks(root, first: dict | None = None):
    """Two tasks whose trajectories last one turn and three (the raw reader with an empty letter passes every answer),
    or ``first`` and three: with one task a rank a step, the two ranks play different numbers of turns in every
    rollout."""
    data = root / "data"
    metas = [first or {"screens": 1}, {"screens": 3}]
    records = [{"messages": [{"role": "user", "content": "Answer anything, one action per turn."},
                             {"role": "assistant", "content": '{"action": "done"}'}],
                "meta": {"id": f"task{k}", **meta}} for k, meta in enumerate(metas)]
    write_sharegpt(data, "tasks", records, columns={"messages": "messages"})
    return data


def check_uneven_run(out, result, factor, turns=(1, 3)):
    """Two steps on two ranks, both ranks' trajectories logged: in every rollout one rank's ended after ``turns[0]``
    turns (0: failed at reset) while the other's took three; what every agent run shows (``check_trajectories``)."""
    assert result.returncode == 0, failure_report(result.stdout + result.stderr)
    assert (out / "adapter_model.safetensors").is_file()
    logged = [row for row in read_log(out) if "loss" in row]
    assert len(logged) == 2
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 4  # two steps, a task on each rank, G 4
    for step in {row["step"] for row in rows}:
        assert {len(row["trajectory"]["turns"]) for row in rows if row["step"] == step} == set(turns)
    for row in rows:
        assert row["trajectory"]["end"] == ("done" if row["trajectory"]["turns"] else "env_error")
    check_trajectories(logged, rows, factor, ("done", "env_error"))
    return logged


UNEVEN = '{"reader": "raw", "letter": "", "change_size": true}'


@pytest.mark.slow
def test_an_agent_trains_under_zero3_on_two_ranks(tiny_model, tmp_path):
    """ZeRO-3 on 2 ranks, HF rollouts with the shared prefix: each rank plays its own task for as many turns as it
    lasts, on weights gathered once per rollout, and no rank waits for the other's turns. Here one rank's task fails
    at every reset: that rank samples nothing and has no screenshot, yet runs the vision tower on a masked dummy (all
    ranks gather its weights together), so both train in step; the failures are counted, not trained."""
    out = tmp_path / "out"
    failing = {"screens": 1, "faults": {"reset": "raise"}}
    config = agent_config(tiny_model, uneven_tasks(tmp_path, failing), out, "qwen2_vl", deepspeed=str(ZERO3),
                          ddp_backend="gloo", use_cpu=None, grpo_agent_env_kwargs=UNEVEN, grpo_beta=0.04)
    logged = check_uneven_run(out, run_ranks(["llamafactory-cli", "train"], config, tmp_path / "run"), 28, (0, 3))
    assert all(row["agent/env_errors"] > 0 for row in logged)


@pytest.mark.slow
def test_an_environment_written_outside_the_project(tiny_model, tasks, tmp_path):
    """``path/to/env.py:Class`` with its keyword arguments: the class is loaded in the worker processes, its
    screenshots are whatever size it draws, and its rewards are the env reward. With ``grpo_agent_credit: gigpo``
    (its ``state_key`` is the screens passed) the steps taken from one state are grouped and the run trains. With
    dynamic sampling a flat group of trajectories is swapped for a fresh task's (or the budget says it stayed)."""
    root, data = tasks
    out = tmp_path / "out"
    config = agent_config(tiny_model, data, out, "qwen2_vl", max_steps=1, save_steps=1,
                          grpo_agent_env=f"{root / 'envs' / 'colour_env.py'}:ColourScreens",
                          grpo_agent_env_kwargs='{"screens": 2}', grpo_agent_credit="gigpo", grpo_agent_gamma=0.9,
                          grpo_dynamic_sampling=True, grpo_max_resample=2)
    result = run_cli(["llamafactory-cli", "train"], config, tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    for row in rows:
        turns = row["trajectory"]["turns"]
        assert tuple(turns[0]["orig_hw"]) == (1600, 900)
        passed = sum("e" in turn["text"] for turn in turns)
        assert row["reward"] == pytest.approx(1.0 if passed >= 2 else 0.0)  # action_format: 0, no JSON action
    [logged] = [row for row in read_log(out) if "loss" in row]
    assert 0 < logged["agent/step_grouped_share"] <= 1 and (out / "adapter_model.safetensors").is_file()
    rewards = {row["reward"] for row in rows}  # the trained group: not flat, unless the budget ran out
    assert logged["dynamic/replaced_groups"] + logged["dynamic/short_groups"] <= 1
    assert len(rewards) > 1 or logged["dynamic/short_groups"] == 1, (rewards, logged)


@pytest.mark.slow
def test_an_environment_that_fails_every_trajectory_stops_the_run(tiny_model, tasks, tmp_path):
    """Every first step raises: all trajectories end env_error, above grpo_agent_max_env_failures; the run stops
    with a message naming the share, the key and the environment's own error, and leaves no adapter."""
    _, data = tasks
    out = tmp_path / "out"
    config = agent_config(tiny_model, data, out, "qwen2_vl", max_steps=1, save_steps=1,
                          grpo_agent_env_kwargs='{"faults": {"step1": "raise"}}')
    result = run_cli(["llamafactory-cli", "train"], config, tmp_path, timeout=1200)
    assert result.returncode != 0
    assert "grpo_agent_max_env_failures" in result.stderr and "simulated failure in step1" in result.stderr
    assert not (out / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("overrides, message", [
    (dict(grpo_agent_env_kwargs="[1]"), "grpo_agent_env_kwargs must be a JSON object"),
    (dict(grpo_agent_env="no_colon"), "grpo_agent_env must be module:Class"),
    (dict(grpo_agent_isolation="thread"), "grpo_agent_isolation must be one of process, inline"),
    (dict(grpo_blank_image_ratio=0.5), "grpo_blank_image_ratio cannot be used with grpo_agent_env"),
    (dict(reward_funcs="env,overlong"), "reward_funcs: overlong cannot be used with grpo_agent_env"),
    (dict(grpo_agent_env=None), "reward 'env' scores environment trajectories: it needs grpo_agent_env"),
    (dict(qwenvl_patch=False), "grpo_agent_env needs `qwenvl_patch: true`"),
    (dict(grpo_agent_max_turns=0), "grpo_agent_max_turns must be in"),
    (dict(grpo_agent_credit="steps"), "grpo_agent_credit must be one of trajectory, gigpo"),
    (dict(grpo_agent_gamma=1.5), "grpo_agent_gamma must be in"),
    (dict(grpo_agent_env="qwenvl_prep.demos.gui_env:ClickThroughEnvs"), "gui_env has no class ClickThroughEnvs"),
    (dict(grpo_agent_env="qwenvl_no_such_env_module:Env"), "module qwenvl_no_such_env_module not found"),
    (dict(grpo_agent_env="llamafactory_qwenvl_patch.agent:Action"), "class Action lacks reset, step, close"),
    (dict(grpo_agent_env="llamafactory_qwenvl_patch.agent:Environment"), "Environment is a Protocol"),
    (dict(grpo_agent_env_kwargs='{"screens": 2, "screens": 3}'), "the key 'screens' appears twice"),
    (dict(grpo_agent_env_kwargs='{"screens": NaN}'), "NaN is not a JSON number"),
    (dict(grpo_agent_step_timeout=2.2e6), "grpo_agent_step_timeout must be in (0, 2.14748e"),
])
def test_agent_keys_are_refused_before_the_model_loads(tiny_model, tasks, tmp_path, overrides, message):
    """Each key's rule, and the environment class itself: loaded and checked against the protocol (EnvLoadError, a
    ValueError) where LF parses the arguments, before the model loads."""
    from llamafactory.hparams import get_train_args

    _, data = tasks
    config = agent_config(tiny_model, data, tmp_path / "out", "qwen2_vl")
    config.update(overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        get_train_args({key: value for key, value in config.items() if value is not None})


@pytest.fixture(scope="module")
def small_model_qwen3_5(tmp_path_factory):
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "small-qwen3_5", "qwen3_5", size="small")


@pytest.mark.slow
@pytest.mark.parametrize("fixture, template, factor", [("small_model_qwen3", "qwen3_vl_nothink", 32),
                                                       ("small_model_qwen3_5", "qwen3_5_nothink", 32)],
                         ids=["qwen3_vl", "qwen3_5"])
def test_an_agent_rolls_out_on_vllm(request, tasks, tmp_path, fixture, template, factor):
    """``grpo_rollout_backend: vllm`` (``--size small`` models: vLLM's CPU attention needs their heads): every turn
    is one request per live trajectory with all its screenshots (the frame guard checks every one), and vLLM samples
    the training model's distribution on the action tokens of three-turn trajectories, packed behind each task's
    root for the loss (log-prob gap ~0, importance weights ~1); the run shows what every agent run must
    (``check_run``: each turn's frame, actions in each screenshot's pixels), from the same stock YAML as the HF run.
    Qwen2.5-VL's vLLM turns run in tests/cli/test_grpo_vllm_cli.py, on one engine over two ranks, with these checks."""
    pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
    _, data = tasks
    out = tmp_path / "out"
    config = agent_config(request.getfixturevalue(fixture), data, out, template, grpo_rollout_backend="vllm", seed=3)
    result = run_cli(["llamafactory-cli", "train"], config, tmp_path, timeout=2400)
    assert result.returncode == 0, result.stderr[-4000:]
    for row in check_run(out, factor):
        # Qwen3.5: vLLM's CPU linear-attention layers drift over three-screenshot prompts (mean 1.2e-3, max 4e-3,
        # the same with and without the shared prefix: the gap is vLLM's, not the packing's)
        assert row["vllm/logp_diff/mean"] < (5e-3 if fixture == "small_model_qwen3_5" else 1e-3)
        assert abs(row["vllm/mismatch/kl"]) < 1e-3
        assert 0.5 < row["vllm/is_weight/mean"] <= 3.0
