"""One optimiser step of the real GRPOTrainer (rollout bookkeeping, loss, transformers' accumulation, SGD) with
accumulation 2 equals the step with one batch of the same completions. Only sampling is fixed (``_generate``
returns chosen completions of very different lengths) so both runs see the same data; everything after it runs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from llamafactory_qwenvl_patch.grpo.rewards.builtin import BUILTIN
from llamafactory_qwenvl_patch.grpo.rewards.registry import Reward
from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta
from llamafactory_qwenvl_patch.grpo.trainer.trainer import GRPOTrainer

G = 4


def finetuning(loss_type: str, **overrides) -> SimpleNamespace:
    return SimpleNamespace(**{
        **dict(grpo_num_generations=G, grpo_steps_per_generation=None, grpo_num_iterations=1, grpo_beta=0.0,
               grpo_epsilon=0.2, grpo_epsilon_high=0.2, grpo_loss_type=loss_type, grpo_scale_rewards="group",
               grpo_skip_zero_std_groups=False, grpo_mask_truncated=False, grpo_importance_sampling="token",
               grpo_log_completions=False, grpo_blank_image_ratio=0.0, grpo_blank_image_penalty=1.0,
               grpo_shared_prefix="auto", grpo_stop_on_reward_failure=True,
        grpo_advantage_estimator="grpo", grpo_cispo_cap=5.0, grpo_delta=None, grpo_entropy_coef=0.0,
        grpo_overlong_buffer=None, grpo_dynamic_sampling=False, grpo_max_resample=4),
        **overrides})


def completions(stop: int, pad: int) -> dict[int, torch.Tensor]:
    """Prompt 0: long completions (7-9 tokens); prompt 1: one or two tokens. Every one ends with the stop token."""
    rows = {0: [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36, 37], [41] * 8],
            1: [[51], [61, 62], [71], [81, 82]]}
    out = {}
    for index, seqs in rows.items():
        width = max(len(s) for s in seqs) + 1
        out[index] = torch.tensor([s + [stop] + [pad] * (width - len(s) - 1) for s in seqs])
    return out


def length_reward(completions, **_):
    return [len(c) / 10 for c in completions]


def step_delta(tiny_model, tmp_path, batch: int, accumulation: int, loss_type: str, shared: str = "auto"
               ) -> dict[str, torch.Tensor]:
    trainer = fixed_trainer(tiny_model, tmp_path / f"{batch}x{accumulation}-{shared}", batch, accumulation,
                            finetuning(loss_type, grpo_shared_prefix=shared))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert trainer.shared_prefix == (shared != "false")
    trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if p.requires_grad}


def fixed_trainer(tiny_model, out, batch: int, accumulation: int, finetuning_args, reward=length_reward,
                  max_steps: int = 1) -> GRPOTrainer:
    """The real GRPOTrainer on two text prompts whose sampled completions are fixed (``completions``)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32)
    stop, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    fixed = completions(stop, pad)
    prompts = {0: tokenizer.encode("Say something long."), 1: tokenizer.encode("Be brief!")}
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, max_steps=max_steps, learning_rate=1.0,
                             optim="sgd", lr_scheduler_type="constant", max_grad_norm=1e9, use_cpu=True,
                             report_to="none", save_strategy="no", logging_steps=1, seed=0)
    trainer = GRPOTrainer(
        model=model, args=args, train_dataset=[{"grpo_index": 0}, {"grpo_index": 1}],
        data_collator=lambda features: {"grpo_features": features}, finetuning_args=finetuning_args,
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "max_new_tokens": 9},
        reward_funcs=[Reward(getattr(reward, "__name__", "reward"), reward, 1.0)], ref_model=None,
        resize_policy=None, coords="model", stop_token_ids=[stop], suppress_token_ids=[], processor=None,
        tokenizer=tokenizer)

    def collate(features):
        indices = [int(f["grpo_index"]) for f in features]
        width = max(len(prompts[i]) for i in indices)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in indices])
        mask = (torch.arange(width).unsqueeze(0) >= torch.tensor([width - len(prompts[i]) for i in indices])
                .unsqueeze(1)).long()
        return {"input_ids": ids, "attention_mask": mask, "indices": indices}, [
            SampleMeta(i, "", "", None) for i in indices]

    def generate(model, batch, config):  # the completions only, as GRPOTrainer._generate returns them
        rows = [fixed[i] for i in batch["indices"]]
        width = max(r.size(1) for r in rows)
        return torch.cat([torch.nn.functional.pad(r, (0, width - r.size(1)), value=pad) for r in rows])

    trainer._collate, trainer._generate = collate, generate
    return trainer


def buggy(completions, **_):
    return [undefined_name for _ in completions]  # noqa: F821 - the user's bug


def test_a_reward_failing_on_every_completion_stops_the_run_with_its_traceback(tiny_model, tmp_path, caplog):
    trainer = fixed_trainer(tiny_model, tmp_path / "stop", 2, 1, finetuning("dapo"), reward=buggy)
    with pytest.raises(RuntimeError, match=r"(?s)reward 'buggy' failed on every completion of this rollout, on the completion .*NameError.*"
                                           r"undefined_name.*grpo_stop_on_reward_failure: false"):
        trainer.train()


def test_a_failing_reward_is_shown_once_when_the_run_goes_on(tiny_model, tmp_path, caplog):
    def flaky(completions, *, indices, **_):  # fails on the second prompt's completions
        return [1 / 0 if index == 1 else 1.0 for index in indices]

    trainer = fixed_trainer(tiny_model, tmp_path / "go-on", 2, 1, finetuning("dapo", grpo_stop_on_reward_failure=False),
                            reward=flaky, max_steps=2)
    with caplog.at_level(logging.WARNING, logger="llamafactory.qwenvl_patch.grpo"):
        trainer.train()
    shown = [r.getMessage() for r in caplog.records if "reward 'flaky' failed" in r.getMessage()]
    assert len(shown) == 1 and "failed on 4 of 8" in shown[0] and "ZeroDivisionError" in shown[0]
    assert trainer.state.log_history[0]["rewards/flaky/errors"] == 4


def test_rewards_that_never_differ_are_reported(tiny_model, tmp_path, caplog):
    """Every group scores alike for 3 rollouts: every advantage is 0, and the run says so once, with a sample."""
    def constant(completions, **_):
        return [0.0] * len(completions)

    trainer = fixed_trainer(tiny_model, tmp_path / "flat", 2, 1, finetuning("dapo"), reward=constant, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="llamafactory.qwenvl_patch.grpo"):
        trainer.train()
    shown = [r.getMessage() for r in caplog.records if "GRPO is not learning" in r.getMessage()]
    assert len(shown) == 1 and "A completion: " in shown[0] and "max_new_tokens" in shown[0]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_accumulation_step_equals_one_batch(tiny_model, tmp_path, loss_type):
    """Also: the shared-prefix step (prompts of different lengths, left-padded) equals the repeated layout's."""
    one = step_delta(tiny_model, tmp_path, batch=2, accumulation=1, loss_type=loss_type)
    accumulated = step_delta(tiny_model, tmp_path, batch=1, accumulation=2, loss_type=loss_type)
    repeated = step_delta(tiny_model, tmp_path, batch=2, accumulation=1, loss_type=loss_type, shared="false")
    moved = [n for n, d in one.items() if d.abs().max() > 0]
    assert moved, "the step changed nothing"
    for name in moved:
        assert torch.allclose(one[name], accumulated[name], atol=1e-6, rtol=1e-4), name
        assert torch.allclose(one[name], repeated[name], atol=1e-6, rtol=1e-4), name


def test_blank_image_groups_are_penalised_against_a_zero_baseline(tiny_model, tmp_path):
    """Image-reliance control: with ratio 1 every prompt is sampled again on a blank copy of its image. A confident
    answer there gets advantage -penalty, an abstention 0, even when the whole blank group answers alike; the real
    group keeps its group-relative advantages."""
    from helpers import save_image
    from transformers import AutoModelForImageTextToText, AutoTokenizer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32)
    stop, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    reference = '{"total": "12"}'
    real = ['{"total": "12"}', '{"total": "13"}', '{"total": "12"}', "no"]
    blank = ['{"total": "12"}', "I cannot see a receipt.", '{"total": "99"}', "{}"]

    def rows(texts):
        ids = [tokenizer.encode(t) + [stop] for t in texts]
        width = max(map(len, ids))
        return torch.tensor([i + [pad] * (width - len(i)) for i in ids])

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, max_steps=1,
                             use_cpu=True, report_to="none", save_strategy="no", seed=0)
    trainer = GRPOTrainer(
        model=model, args=args, train_dataset=[{"grpo_index": 0}], data_collator=lambda f: {"grpo_features": f},
        finetuning_args=finetuning("dapo", grpo_blank_image_ratio=1.0, grpo_blank_image_penalty=0.5),
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "max_new_tokens": 16},
        reward_funcs=[Reward("fields", BUILTIN["fields"], 1.0)], ref_model=None, resize_policy=None, coords="model",
        stop_token_ids=[stop], suppress_token_ids=[], processor=None, tokenizer=tokenizer)
    prompt = tokenizer.encode("Read the total.")

    def collate(features):
        assert [bool(f.get("grpo_blank")) for f in features] == [False, True]
        assert features[1]["images"][0].getextrema() == ((128, 128),) * 3  # uniform grey
        assert features[1]["images"][0].size == (640, 480)
        ids = torch.tensor([prompt] * len(features))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "blank": [1 if f.get("grpo_blank") else 0
                                                                                     for f in features]}, [
            SampleMeta(0, "p", reference, (480, 640), blank=bool(f.get("grpo_blank"))) for f in features]

    def generate(model, batch, config):
        real_rows, blank_rows = rows(real), rows(blank)
        width = max(real_rows.size(1), blank_rows.size(1))
        widen = lambda t: torch.nn.functional.pad(t, (0, width - t.size(1)), value=pad)  # noqa: E731
        return torch.cat([widen(real_rows), widen(blank_rows)])

    trainer._collate, trainer._generate = collate, generate
    image = save_image(tmp_path / "receipt.jpg", 640, 480)
    [micro] = trainer._rollout(trainer.model, [{"grpo_index": 0, "images": [str(image)]}])
    assert micro.advantages[G:].tolist() == [-0.5, 0.0, -0.5, 0.0]
    fields = torch.tensor(BUILTIN["fields"](real, references=[reference] * G))
    expected = (fields - fields.mean()) / (fields.std() + 1e-4)
    assert torch.allclose(micro.advantages[:G], expected, atol=1e-4)
    assert trainer.run_state.metrics["blank/confident_rate"] == [0.5]
    assert trainer.run_state.metrics["reward"] == [pytest.approx(float(fields.mean()))]  # real groups only


def half_flat(completions, *, indices, **_):
    """Prompt 0's completions all score alike (a flat group); prompt 1's differ."""
    return [0.5 if index == 0 else len(c) / 10 for c, index in zip(completions, indices)]


def test_dynamic_sampling_replaces_flat_groups_with_fresh_prompts(tiny_model, tmp_path):
    """Issue 42, item 3: prompt 0's flat group is swapped for the group of a freshly drawn prompt 1 whose rewards
    differ; the swapped part is collated again, its completions are the donor's rows, and every group now learns."""
    from llamafactory_qwenvl_patch.grpo.algorithm.dynamic_sampling import fresh_indices

    trainer = fixed_trainer(tiny_model, tmp_path / "dynamic", 2, 1,
                            finetuning("dapo", grpo_dynamic_sampling=True, grpo_max_resample=4,
                                       grpo_shared_prefix="false"), reward=half_flat)
    [micro] = trainer._rollout(trainer.model, [{"grpo_index": 0}, {"grpo_index": 1}])
    draws = [fresh_indices(2, 2, 0, 0, 0, attempt) for attempt in range(4)]
    attempts = next(n for n in range(1, 5) if 1 in draws[n - 1])
    assert trainer.run_state.metrics["dynamic/replaced_groups"] == [1.0] and trainer.run_state.metrics["dynamic/short_groups"] == [0.0]
    assert trainer.run_state.metrics["dynamic/resampled_batches"] == [float(attempts)]
    stop, pad = trainer.tokenizer.convert_tokens_to_ids("<|im_end|>"), trainer.tokenizer.pad_token_id
    expected = completions(stop, pad)[1]
    width = micro.completion_ids.size(1)
    for rows in (micro.completion_ids[:G], micro.completion_ids[G:]):  # both groups are prompt 1's now
        assert torch.equal(rows[:, :expected.size(1)], expected) and (rows[:, expected.size(1):width] == pad).all()
    prompt = trainer.tokenizer.encode("Be brief!")
    assert all(row[-len(prompt):].tolist() == prompt for row in micro.inputs["input_ids"][:, :-width])
    assert (micro.advantages.view(2, G).std(dim=1) > 0).all()


def test_dynamic_sampling_says_when_the_batch_comes_up_short(tiny_model, tmp_path):
    def constant(completions, **_):
        return [0.0] * len(completions)

    trainer = fixed_trainer(tiny_model, tmp_path / "short", 2, 1,
                            finetuning("dapo", grpo_dynamic_sampling=True, grpo_max_resample=2), reward=constant)
    [micro] = trainer._rollout(trainer.model, [{"grpo_index": 0}, {"grpo_index": 1}])
    assert trainer.run_state.metrics["dynamic/short_groups"] == [2.0] and trainer.run_state.metrics["dynamic/resampled_batches"] == [2.0]
    assert micro.completion_ids.size(0) == 2 * G and not micro.advantages.any()


def test_a_new_estimator_and_a_new_loss_are_one_registration_each(tiny_model, tmp_path):
    """Issue 48: a variant is one place. A toy estimator (the reward itself, no baseline) and a toy loss (the clipped
    surrogate summed over tokens) are registered, and the real trainer takes one step with each: the estimator's
    advantages reach the micro-batch, and the loss is its aggregation of the surrogate."""
    from llamafactory_qwenvl_patch.grpo.algorithm import advantages, losses

    @advantages.register_estimator("toy_raw_reward", group_baseline=False)
    def raw(rewards, lengths, group_size, scale, ranks):
        return rewards.clone()

    @losses.register_aggregation("toy_token_sum")
    def token_sum(per_token, mask, config, token_normalizer, seq_normalizer):
        return (per_token * mask).sum()

    losses.register_loss("toy_sum", "clipped", "toy_token_sum")
    try:
        trainer = fixed_trainer(tiny_model, tmp_path / "toy", 2, 1,
                                finetuning("toy_sum", grpo_advantage_estimator="toy_raw_reward"))
        [micro] = trainer._rollout(trainer.model, [{"grpo_index": 0}, {"grpo_index": 1}])
        texts = [trainer.tokenizer.decode(row[row != trainer.tokenizer.pad_token_id][:-1]) for row in
                 micro.completion_ids]
        assert torch.allclose(micro.advantages, torch.tensor(length_reward(texts)))
        loss = trainer.compute_loss(trainer.model, {"grpo": micro})
        assert torch.allclose(loss, -(micro.advantages.unsqueeze(1) * micro.mask).sum(), atol=1e-5)  # ratio 1
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    finally:
        advantages.ESTIMATOR_REGISTRY.pop("toy_raw_reward")
        losses.AGGREGATIONS.pop("toy_token_sum")
        losses.LOSS_TYPES.pop("toy_sum")
