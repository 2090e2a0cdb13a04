"""``llamafactory-cli train`` with ``stage: grpo`` on the tiny model (CPU): LoRA with evaluation, resume, no
reference, full fine-tuning with and without a frozen reference, ZeRO-3 on 2 ranks, Qwen2-VL box tokens, SFT adapter
-> GRPO, and a mixed-size batch of 4 with accumulation and rollout reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    failure_report,
    grounding_record,
    image_pad_loving_model,
    read_log,
    run_cli,
    run_ranks,
    save_image,
    train_config,
    write_sharegpt,
)

from llamafactory_qwenvl_patch.grpo.generation.settings import VISION_TOKENS
from llamafactory_qwenvl_patch.model_files.experts import cpu_grouped_mm_runs

REWARDS = '''
import zlib


def one(completions, **kw):
    return [1.0] * len(completions)


def boom(completions, **kw):
    raise RuntimeError("a user bug")


def spread(completions, *, references, prompts, orig_sizes, model_sizes, resize_policy, indices, coords):
    assert len(references) == len(prompts) == len(orig_sizes) == len(model_sizes) == len(indices) == len(completions)
    assert all(m[0] % resize_policy.factor == 0 for m in model_sizes) and coords == "model"
    return [(zlib.crc32(c.encode()) % 100) / 100 for c in completions]


def spread_rel1000(completions, *, model_sizes, resize_policy, coords, **kw):
    assert coords == "rel1000" and resize_policy.factor == 32 and all(m[0] % 32 == 0 for m in model_sizes)
    return [(zlib.crc32(c.encode()) % 100) / 100 for c in completions]


def spread_odd(completions, *, indices, **kw):
    """Flat for even records (every completion 0.5), spread for odd ones: dynamic sampling has groups to swap."""
    return [0.5 if i % 2 == 0 else (zlib.crc32(c.encode()) % 100) / 100 for c, i in zip(completions, indices)]


def self_iou(completions, *, references, **kw):
    """1 when the reference, as rewards receive it, scores IoU 1 against itself."""
    from llamafactory_qwenvl_patch.grpo.rewards.builtin import iou_reward

    return iou_reward(references, references=references)
'''
CONFIG = Path(__file__).resolve().parents[2] / "configs"
LF_REFERENCE_COPY = "Created reference model from the model itself."  # LF's create_ref_model, full fine-tuning
STARTING_ADAPTER_REFERENCE = "GRPO reference: the starting adapter"  # ours, when LF resumes the given adapter


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
           "completion_length/max", "parse_failures", "rewards/iou/mean", "rewards/format/std", "entropy"]


@pytest.fixture(scope="module")
def lora_run(setup, tiny_model):
    root, data_dir = setup
    out = root / "lora"
    config = grpo_config(tiny_model, data_dir, out, root / "my_rewards.py", grpo_log_completions=True,
                         reward_funcs=f"iou,format,{root / 'my_rewards.py'}:one,{root / 'my_rewards.py'}:boom,"
                                      "click,overlong",
                         reward_weights="1,1,0.5,1,0,0", val_size=0.5, eval_strategy="steps", eval_steps=3,
                         grpo_advantage_estimator="rloo", grpo_overlong_buffer=4,
                         grpo_stop_on_reward_failure=False,
                         per_device_eval_batch_size=2, do_eval=True, enable_torch_profiler=True,
                         profiler_with_stack=False)
    result = run_cli(["llamafactory-cli", "train"], config, root / "lora-run")
    assert result.returncode == 0, result.stderr[-4000:]
    return root, out, config


@pytest.mark.slow
def test_a_generation_batch_the_data_cannot_fill_is_refused_before_the_model_loads(setup, tiny_model):
    """Issue 51, class 9: four prompts and a generation batch of eight (batch 4 x grpo_steps_per_generation 2) was
    found by the trainer's sampler, after the model loaded; the run stops once the dataset is read."""
    root, data_dir = setup
    config = grpo_config(tiny_model, data_dir, root / "too-few", root / "my_rewards.py", per_device_train_batch_size=4,
                         grpo_steps_per_generation=2)
    result = run_cli(["llamafactory-cli", "train"], config, root / "too-few-run")
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "the training set has 4 prompts but one generation batch needs 8" in output
    assert "trainable params" not in output  # LF's line once the model is loaded


@pytest.mark.slow
def test_lora_grpo_logs_metrics_weights_and_errors(lora_run):
    _, out, _ = lora_run
    steps = [row for row in read_log(out) if "loss" in row]
    assert [row["current_steps"] for row in steps] == [1, 2, 3]
    for row in steps:
        assert all(name in row for name in METRICS), sorted(row)
        assert row["reward"] == pytest.approx(0.5)  # 0 (iou) + 0 (format) + 0.5 * 1 (one) + 0 (boom raised)
        assert row["rewards/boom/errors"] == 4  # every completion of the step, counted, training went on
        # issue 42: the overlong reward (weight 0 here) and, in a run rewarded for clicks, the click monitors
        assert -1 <= row["rewards/overlong/mean"] <= 0
        assert 0 <= row["monitor/click_multi_point_rate"] <= 1 and 0 <= row["monitor/click_same_point_group_rate"] <= 1
    assert any(row["rewards/overlong/mean"] < 0 for row in steps)  # 12 new tokens, the last 4 punished
    assert (out / "checkpoint-3" / "adapter_model.safetensors").exists()
    assert json.loads((out / "checkpoint-3" / "preprocessor_config.json").read_text())["size"]["longest_edge"] == \
        256 * 28 * 28
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {"prompt", "completion", "reward", "reference", "index"} <= set(rows[0])
    assert "Locate the box" in rows[0]["prompt"] and "bbox_2d" in rows[0]["reference"]
    assert (out / "training_reward.png").exists()


@pytest.mark.slow
def test_lf_callback_keys_work_under_grpo(lora_run):
    """``enable_torch_profiler`` (an LF callback key) acts under ``stage: grpo`` as under LF's own stages."""
    _, out, _ = lora_run
    traces = list((out / "profiler" / "rank_0").glob("*.json*"))
    assert traces and all(trace.stat().st_size > 0 for trace in traces)


@pytest.mark.slow
def test_eval_set_is_evaluated(lora_run):
    """Defect 7: val_size + eval_strategy evaluate greedy answers: rewards and grounding metrics as eval_*."""
    _, out, _ = lora_run
    evals = [row for row in read_log(out) if "eval_reward" in row]
    assert [row["current_steps"] for row in evals] == [3]
    row = evals[0]
    assert row["eval_samples"] == 2 and row["eval_rewards/one/mean"] == 1.0
    assert row["eval_reward"] == pytest.approx(0.5 + row["eval_rewards/iou/mean"] + row["eval_rewards/format/mean"])
    assert {"eval_acc@0.5", "eval_mean_iou", "eval_parse_failure_rate"} <= set(row)
    final = json.loads((out / "eval_results.json").read_text())  # do_eval after training, as LF's workflows do
    assert final["eval_samples"] == 2 and "eval_reward" in final


@pytest.mark.slow
def test_resume_continues_the_step_count(lora_run):
    root, out, config = lora_run
    resumed = {**config, "max_steps": 5, "save_steps": 5, "resume_from_checkpoint": str(out / "checkpoint-3")}
    result = run_cli(["llamafactory-cli", "train"], resumed, root / "resume-run")
    assert result.returncode == 0, result.stderr[-4000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 5
    assert [row["step"] for row in state["log_history"] if "loss" in row][-2:] == [4, 5]


def assert_same_training(shared: list[dict], repeated: list[dict]) -> None:
    """The same seed with the shared prefix and without: the same completions (rewards equal exactly), the same
    loss and KL up to float rounding (the loss is a sum of terms that nearly cancel: compared in absolute terms)."""
    assert len(shared) == len(repeated) > 0
    for ours, theirs in zip(shared, repeated):
        for key in ("reward", "reward_std", "completion_length/mean"):
            if key in theirs:
                assert ours[key] == theirs[key], key
        for key in ("loss", "kl", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_zero3_two_ranks(request, setup, tiny_model, tiny_model_qwen3_5, family):
    """ZeRO-3 on 2 ranks, the shared prefix (on by default) against the repeated layout; Qwen3.5's linear-attention
    layers run their packed forward on parameters ZeRO-3 gathers per module; Qwen2.5-VL with CISPO, an entropy
    bonus and dynamic sampling (issue 42: the ranks resample in step), starting from an SFT adapter: ZeRO-3 (the 7B
    config) cannot merge adapters, so LF always resumes the SFT adapter, and the frozen copy must be the reference
    there too (the first step's KL is 0, and no reference copy is saved with the checkpoint)."""
    root, data_dir = setup
    model, extra = tiny_model, dict(grpo_loss_type="cispo", grpo_entropy_coef=0.01, grpo_dynamic_sampling=True,
                                    reward_funcs=f"format,{root / 'my_rewards.py'}:spread_odd",
                                    adapter_name_or_path=str(request.getfixturevalue("sft_adapter")),
                                    create_new_adapter=True)
    if family == "qwen3_5":
        model, extra = tiny_model_qwen3_5, dict(template="qwen3_5_nothink", image_min_pixels=64 * 32 * 32,
                                                image_max_pixels=256 * 32 * 32,
                                                reward_funcs=f"format,{root / 'my_rewards.py'}:spread_rel1000")
    logs, outputs = {}, {}
    for shared in ("auto", "false"):
        out = root / f"z3-{family}-{shared}"
        config = grpo_config(model, data_dir, out, root / "my_rewards.py",
                             deepspeed=str(CONFIG / "ds_z3_cpu_test.json"), ddp_backend="gloo", use_cpu=None,
                             grpo_scale_rewards="batch", grpo_shared_prefix=shared, **extra)
        result = run_ranks(["llamafactory-cli", "train"], config, root / f"z3-run-{family}-{shared}")
        output = result.stdout + result.stderr
        assert result.returncode == 0, failure_report(output)
        assert ("grpo_shared_prefix: on" in output) == (shared == "auto")
        logs[shared], outputs[shared] = [row for row in read_log(out) if "loss" in row], output
    steps = logs["auto"]
    assert len(steps) == 3 and steps[-1]["kl"] > 0
    assert (root / f"z3-{family}-auto" / "checkpoint-3" / "adapter_model.safetensors").exists()
    assert_same_training(steps, logs["false"])
    if family == "qwen2_5_vl":
        assert sum(row["dynamic/replaced_groups"] for row in steps) > 0
        assert all(row["frac_reward_zero_std"] < 1 for row in steps)
        assert STARTING_ADAPTER_REFERENCE in outputs["auto"]
        assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)
        assert not (root / f"z3-{family}-auto" / "checkpoint-3" / "grpo_reference").exists()


@pytest.mark.slow
def test_qwen3_vl_full_finetuning_with_a_frozen_reference(setup, tiny_model_qwen3):
    """Qwen3-VL: factor 32, 0-1000 coordinates, and the token types its M-RoPE needs in transformers 5.x; full
    fine-tuning with beta > 0 creates a frozen copy of the model as the reference, which the policy leaves."""
    root, data_dir = setup
    out = root / "qwen3"
    config = grpo_config(tiny_model_qwen3, data_dir, out, root / "my_rewards.py", template="qwen3_vl_nothink",
                         image_min_pixels=64 * 32 * 32, image_max_pixels=256 * 32 * 32, max_steps=2, save_steps=2,
                         finetuning_type="full", grpo_beta=0.04, learning_rate=1e-3,
                         reward_funcs=f"format,{root / 'my_rewards.py'}:spread_rel1000")
    result = run_cli(["llamafactory-cli", "train"], config, root / "qwen3-run")
    output = result.stdout + result.stderr
    assert result.returncode == 0, failure_report(output)
    assert LF_REFERENCE_COPY in output
    steps = [row for row in read_log(out) if "loss" in row]
    assert len(steps) == 2 and steps[0]["rewards/spread_rel1000/errors"] == 0 and steps[0]["reward_std"] > 0
    assert steps[1]["kl"] > 0  # the policy moved away from its frozen copy after one update
    assert (out / "model.safetensors").exists()


def box_token_record(image: Path) -> dict:
    answer = "<|object_ref_start|>box<|object_ref_end|><|box_start|>(12,34),(560,780)<|box_end|>"
    return {"messages": [{"role": "user", "content": "<image>Find the box."},
                         {"role": "assistant", "content": answer}], "images": [str(image)]}


@pytest.mark.slow
def test_qwen2vl_box_token_answers_reach_rewards(setup, tiny_model):
    """Defect 1: references and completions keep the Qwen2-VL grounding tokens, so iou/format/parse_failures work.
    Also grpo_steps_per_generation 2 with accumulation 1: one rollout, old log-probs, two optimiser steps; and full
    fine-tuning with beta 0: no reference model is created and KL stays 0."""
    root, data_dir = setup
    write_sharegpt(data_dir, "boxtokens", [box_token_record(data_dir / f"g{i}.jpg") for i in range(2)])
    out = root / "boxtokens"
    config = grpo_config(tiny_model, data_dir, out, root / "my_rewards.py", dataset="boxtokens", max_steps=2,
                         save_steps=2, grpo_log_completions=True, grpo_steps_per_generation=2,
                         finetuning_type="full", grpo_beta=0.0, learning_rate=1e-3,
                         reward_funcs=f"iou,format,{root / 'my_rewards.py'}:self_iou")
    result = run_cli(["llamafactory-cli", "train"], config, root / "boxtokens-run")
    output = result.stdout + result.stderr
    assert result.returncode == 0, failure_report(output)
    assert LF_REFERENCE_COPY not in output
    steps = [row for row in read_log(out) if "loss" in row]
    assert len(steps) == 2 and "reward" not in steps[1]  # one rollout (2 micro-batches) serves both steps
    assert all(row["kl"] == 0 for row in steps) and (out / "model.safetensors").exists()
    rollout = steps[0]
    assert rollout["rewards/self_iou/mean"] == 1.0  # was 0.0: the tokens were stripped
    assert rollout["parse_failures"] == 8 and rollout["rewards/format/mean"] == 0.0  # random model, 2 prompts x 4
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    assert rows[0]["reference"].startswith("<|object_ref_start|>box<|object_ref_end|><|box_start|>(")


@pytest.fixture(scope="module")
def sft_adapter(setup, tiny_model):
    root, data_dir = setup
    out = root / "sft"
    result = run_cli(["llamafactory-cli", "train"], train_config(
        tiny_model, data_dir, out, learning_rate=5e-3, max_steps=4, save_steps=4), root / "sft-run")
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.mark.slow
def test_sft_adapter_changes_the_model(tiny_model, sft_adapter):
    """Precondition of the next test: the SFT adapter moves the model, so 'disable the adapter' is not the start."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_model), sft_adapter)
    ids = torch.arange(5, 45).unsqueeze(0)
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert (tuned - base).abs().max() > 1e-2


@pytest.mark.slow
def test_sft_adapter_merged_into_the_reference(setup, tiny_model, sft_adapter):
    """Defect 3: SFT -> GRPO starts with KL 0 to the model the run starts from when LF merges the SFT adapter and
    trains a new one (the base with the adapter disabled is the reference). LF resuming the SFT adapter (a frozen
    copy is the reference): test_dynamic_sampling_resumes_as_the_same_run and ZeRO-3 on Qwen2.5-VL."""
    root, data_dir = setup
    out = root / "sft-grpo"
    config = grpo_config(tiny_model, data_dir, out, root / "my_rewards.py", adapter_name_or_path=str(sft_adapter),
                         create_new_adapter=True, max_steps=2, save_steps=1, learning_rate=5e-3)
    result = run_cli(["llamafactory-cli", "train"], config, root / "sft-grpo-run")
    output = result.stdout + result.stderr
    assert result.returncode == 0, failure_report(output)
    assert STARTING_ADAPTER_REFERENCE not in output
    steps = [row for row in read_log(out) if "loss" in row]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # was 0.0437 with the SFT adapter trainable
    assert steps[1]["kl"] > 0
    for checkpoint in ("checkpoint-1", "checkpoint-2"):
        assert (out / checkpoint / "adapter_model.safetensors").exists()
        assert not (out / checkpoint / "grpo_reference").exists()


@pytest.mark.slow
def test_mixed_batch_accumulation_and_rollout_reuse(setup, tiny_model, tmp_path_factory):
    """Batch of 4 mixed-size images, G 4, gradient accumulation 2, each rollout optimised twice (clipping acts),
    dapo with two-sided clipping, REINFORCE++ advantages and an entropy bonus (issue 42: the shared prefix equal to
    the repeated layout with every one of them), on a model that samples <|image_pad|> at half the positions unless
    suppressed (defect 6) and ships a near-greedy generation_config.json (defect 4)."""
    root, data_dir = setup
    sizes = [(640, 480), (1920, 1080), (333, 777), (1024, 768), (300, 300), (800, 200), (500, 1500), (1200, 900)]
    write_sharegpt(data_dir, "mixed", [grounding_record(save_image(data_dir / f"m{i}.jpg", *s))
                                       for i, s in enumerate(sizes)])
    model = image_pad_loving_model(tiny_model, tmp_path_factory.mktemp("padlover") / "model")
    logs = {}
    for shared in ("auto", "false"):  # auto: the shared prefix, on by default
        out = root / f"mixed-{shared}"
        config = grpo_config(model, data_dir, out, root / "my_rewards.py", dataset="mixed", max_steps=2,
                             save_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             grpo_num_iterations=2, grpo_loss_type="dapo", learning_rate=5e-2, grpo_epsilon=0.02,
                             grpo_log_completions=True, reward_funcs=f"{root / 'my_rewards.py'}:spread",
                             grpo_shared_prefix=shared, grpo_delta=1.5, grpo_advantage_estimator="reinforce_plus_plus",
                             grpo_entropy_coef=0.01)
        result = run_cli(["llamafactory-cli", "train"], config, root / f"mixed-run-{shared}")
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        assert ("grpo_shared_prefix: on" in result.stdout + result.stderr) == (shared == "auto")
        logs[shared] = [row for row in read_log(out) if "loss" in row]
    assert_same_training(logs["auto"], logs["false"])
    out = root / "mixed-auto"
    steps = logs["auto"]
    assert len(steps) == 2
    assert steps[0]["clip_ratio"] == 0.0  # first pass over the rollout is on-policy
    assert steps[1]["clip_ratio"] > 0  # second pass after an update: ratios leave [1 - eps, 1 + eps]
    assert steps[0]["vision_tokens_cut"] == 0
    assert all(row["entropy"] > 0 for row in steps)
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 * 4  # one rollout of 8 prompts for both steps
    assert not any(token in row["completion"] for token in VISION_TOKENS for row in rows)  # placeholders suppressed
    groups = {}
    for row in rows:
        groups.setdefault(row["index"], set()).add(row["completion"])
    assert all(len(texts) > 1 for texts in groups.values())  # sampled, not the checkpoint's top_k 1


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_shared_prefix_equals_the_repeated_layout(setup, tiny_model_qwen3_5, tiny_model_qwen3_5_moe, moe):
    """Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet and full-attention layers; LoRA on every linear layer, the
    linear-attention projections included): batch 2 of mixed sizes, accumulation 2, the same seed with the shared
    prefix (on by default) and without give the same rewards, loss and KL, and adapters within 1e-5. SGD, so that
    the adapters compare the gradients: Adam's first step moves every element by about lr whatever its gradient,
    so float rounding in a near-zero gradient would flip whole steps. The MoE runs its experts eager on this CPU
    (said once in the log)."""
    from safetensors.torch import load_file

    root, data_dir = setup
    model = tiny_model_qwen3_5_moe if moe else tiny_model_qwen3_5
    logs, adapters = {}, {}
    for shared in ("auto", "false"):
        out = root / f"q35-{moe}-{shared}"
        config = grpo_config(model, data_dir, out, root / "my_rewards.py", template="qwen3_5_nothink",
                             image_min_pixels=64 * 32 * 32, image_max_pixels=256 * 32 * 32, max_steps=2,
                             save_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             optim="sgd", learning_rate=0.1,
                             reward_funcs=f"{root / 'my_rewards.py'}:spread_rel1000",
                             grpo_shared_prefix=shared)
        result = run_cli(["llamafactory-cli", "train"], config, root / f"q35-run-{moe}-{shared}")
        output = result.stdout + result.stderr
        assert result.returncode == 0, failure_report(output)
        assert ("grpo_shared_prefix: on" in output) == (shared == "auto")
        assert ("experts_implementation=eager" in output) == (moe and not cpu_grouped_mm_runs())
        logs[shared] = [row for row in read_log(out) if "loss" in row]
        adapters[shared] = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    assert_same_training(logs["auto"], logs["false"])
    assert logs["auto"][0]["reward_std"] > 0
    assert any("linear_attn.in_proj_qkv" in name for name in adapters["auto"])
    moved = 0
    for name, tensor in adapters["false"].items():
        assert (adapters["auto"][name] - tensor).abs().max() <= 1e-5, name
        moved += bool(tensor.abs().max() > 1e-4 and "lora_B" in name)
    assert moved > 0


@pytest.mark.slow
def test_dynamic_sampling_resumes_as_the_same_run(setup, tiny_model, sft_adapter):
    """Issue 42, item 3: a run with dynamic sampling stopped at its checkpoint and resumed draws the same fresh
    prompts, samples the same completions and ends with the same adapter as the run that went straight through.
    The runs train the SFT adapter further (defect 3: LF resumes it, a frozen copy of it is the reference, KL 0 at
    the first step), so the resumed run must rebuild that reference from the starting adapter, not the checkpoint."""
    import torch
    from safetensors.torch import load_file

    root, data_dir = setup
    settings = dict(grpo_dynamic_sampling=True, reward_funcs=f"format,{root / 'my_rewards.py'}:spread_odd",
                    grpo_advantage_estimator="reinforce_plus_plus_baseline", adapter_name_or_path=str(sft_adapter),
                    grpo_log_completions=True, max_steps=4, save_steps=2, lr_scheduler_type="constant",
                    learning_rate=5e-2)
    whole, cut = root / "dynamic-whole", root / "dynamic-cut"
    for out, extra in ((whole, {}), (cut, {"max_steps": 2}),
                       (cut, {"resume_from_checkpoint": str(cut / "checkpoint-2")})):
        config = grpo_config(tiny_model, data_dir, out, root / "my_rewards.py", **{**settings, **extra})
        result = run_cli(["llamafactory-cli", "train"], config, root / f"{out.name}-run")
        output = result.stdout + result.stderr
        assert result.returncode == 0, failure_report(output)
        assert STARTING_ADAPTER_REFERENCE in output
    timing = ("elapsed_time", "remaining_time", "throughput", "total_steps", "percentage")  # the cut run's plan: 2
    logs = [[{k: v for k, v in row.items() if k not in timing} for row in read_log(out) if "loss" in row]
            for out in (whole, cut)]
    assert [row["current_steps"] for row in logs[1]] == [1, 2, 3, 4] and logs[0] == logs[1]
    assert sum(row["dynamic/replaced_groups"] for row in logs[0][2:]) > 0  # after the resume too
    assert logs[0][0]["kl"] == pytest.approx(0.0, abs=1e-6) and logs[0][-1]["kl"] > 0  # starts at its reference
    for checkpoint in (out / name for out in (whole, cut) for name in ("checkpoint-2", "checkpoint-4")):
        assert (checkpoint / "adapter_model.safetensors").exists() and not (checkpoint / "grpo_reference").exists()
    assert (whole / "completions.jsonl").read_text() == (cut / "completions.jsonl").read_text()
    expected, got = (load_file(out / "adapter_model.safetensors") for out in (whole, cut))
    assert all(torch.equal(expected[name], got[name]) for name in expected)
