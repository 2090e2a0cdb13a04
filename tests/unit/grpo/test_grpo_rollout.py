"""GRPO rollout pieces: what rewards see, step-wide normalisers under gradient accumulation, sampling settings,
reward errors per completion, vision-token safety and the rollout sampler."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llamafactory_qwenvl_patch.grpo.algorithm.advantages import zero_std_groups
from llamafactory_qwenvl_patch.grpo.algorithm.losses import (
    LossConfig,
    micro_batch_counts,
    policy_loss,
    step_normalizers,
)
from llamafactory_qwenvl_patch.grpo.generation.settings import sampling_settings, vision_token_ids
from llamafactory_qwenvl_patch.grpo.rewards.builtin import BUILTIN
from llamafactory_qwenvl_patch.grpo.rewards.registry import Reward, load_rewards, score
from llamafactory_qwenvl_patch.grpo.rollout.tensors import completion_mask, cut_at_tokens, decode_kept, prompt_text
from llamafactory_qwenvl_patch.grpo.trainer.prompt_order import RolloutSampler
from llamafactory_qwenvl_patch.integration.yaml_keys import explicit_keys

QWEN2_ANSWER = "<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(10,20),(110,220)<|box_end|>"


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_grounding_tokens_survive_decoding(tokenizer):
    """Defect 1: Qwen2-VL answers live in special tokens; decoding for rewards keeps them, drops stop and pad."""
    stop, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    ids = tokenizer.encode(QWEN2_ANSWER) + [stop, pad, pad]
    text = decode_kept(tokenizer, ids, {stop, pad})
    assert text == QWEN2_ANSWER
    assert tokenizer.decode(ids, skip_special_tokens=True) != QWEN2_ANSWER  # what the old decoding gave rewards
    assert BUILTIN["iou"]([text], references=[text]) == [1.0]
    assert BUILTIN["format"](["qwerty", text], references=[text, text]) == [0.0, 1.0]


def test_prompt_text_shows_each_image_once(tokenizer):
    ids = tokenizer.encode("<|vision_start|>" + "<|image_pad|>" * 50 + "<|vision_end|>Where is the cat?")
    assert prompt_text(tokenizer, ids, {tokenizer.pad_token_id}) == \
        "<|vision_start|><|image_pad|><|vision_end|>Where is the cat?"


def simulate_step(micro_batches, world_size, grad_accum, loss_type="dapo"):
    """What one optimiser step does with the trainer's micro-batch losses: transformers' Trainer divides each by
    ``gradient_accumulation_steps`` and sums the gradients; DDP / DeepSpeed average them over ranks."""
    counts = micro_batch_counts([m for _, m, _ in micro_batches])
    # ranks hold consecutive runs of micro-batches; the trainer sums counts over ranks before normalising
    per_rank = counts.view(world_size, -1, 2).sum(0)
    norms = step_normalizers(per_rank, grad_accum, world_size)
    grads = []
    for i, (logps, mask, adv) in enumerate(micro_batches):
        logps = logps.clone().requires_grad_(True)
        token_norm, seq_norm = norms[i % len(norms)].tolist()
        loss = policy_loss(logps, logps.detach(), None, adv, mask, LossConfig(0.0, 0.2, 0.2, loss_type, logps.size(1)),
                           token_norm, seq_norm).loss / grad_accum
        loss.backward()
        grads.append(logps.grad / world_size)
    return grads


def one_batch(micro_batches, loss_type="dapo"):
    width = max(lp.size(1) for lp, _, _ in micro_batches)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.size(1)))  # noqa: E731
    logps = torch.cat([pad(lp) for lp, _, _ in micro_batches]).requires_grad_(True)
    mask = torch.cat([pad(m) for _, m, _ in micro_batches])
    adv = torch.cat([a for _, _, a in micro_batches])
    policy_loss(logps, logps.detach(), None, adv, mask, LossConfig(0.0, 0.2, 0.2, loss_type, width)).loss.backward()
    return logps.grad


def micro(rows, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, max(tokens), generator=g)
    mask = torch.tensor([[1.0] * n + [0.0] * (max(tokens) - n) for n in tokens])
    return logps, mask, torch.randn(rows, generator=g)


def test_dapo_is_a_token_mean_over_the_whole_step_under_accumulation():
    """Defect 2: micro-batches of 42 and 6 completion tokens (the audit's case) get the per-token gradient of one
    batch holding both; the old per-micro-batch normaliser gave 0.571 and 4.0 of it."""
    batches = [micro(3, [14, 14, 14], 0), micro(3, [2, 2, 2], 1)]
    assert [int(m.sum()) for _, m, _ in batches] == [42, 6]
    reference = one_batch(batches)
    grads = simulate_step(batches, world_size=1, grad_accum=2)
    assert torch.allclose(grads[0], reference[:3, :14], atol=1e-7)
    assert torch.allclose(grads[1], reference[3:, :2], atol=1e-7)
    for (lp, m, a), ratio, rows in zip(batches, (0.571, 4.0), (slice(0, 3), slice(3, 6))):
        x = lp.clone().requires_grad_(True)  # the old normaliser: this micro-batch's own tokens
        (policy_loss(x, x.detach(), None, a, m, LossConfig(0.0, 0.2, 0.2, "dapo", 14)).loss / 2).backward()
        used = m.bool()
        measured = (x.grad[used] / reference[rows, :lp.size(1)][used]).mean().item()
        assert measured == pytest.approx(ratio, abs=1e-3)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=4, max_size=4), st.integers(0, 10**6))
def test_accumulated_ranks_match_one_batch(loss_type, lengths, seed):
    """Two ranks x GA 2 with any completion lengths (and empty rows, as masking leaves them) equal one batch."""
    batches = [micro(len(row), [max(n, 0) for n in row], seed + i) for i, row in enumerate(lengths)]
    batches = [(lp if lp.size(1) else torch.zeros(lp.size(0), 1), m if m.size(1) else torch.zeros(m.size(0), 1), a)
               for lp, m, a in batches]
    reference = one_batch(batches, loss_type)
    grads = simulate_step(batches, world_size=2, grad_accum=2, loss_type=loss_type)
    row = 0
    for (lp, _, _), grad in zip(batches, grads):
        assert torch.allclose(grad, reference[row:row + lp.size(0), :lp.size(1)], atol=1e-6)
        row += lp.size(0)


def test_sequence_importance_is_one_ratio_per_sequence():
    logps = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    old = torch.tensor([[-1.5, -1.5], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    token = policy_loss(logps, old, None, torch.tensor([1.0, 1.0]), mask, LossConfig(0.0, 0.2, 0.2, "grpo", 2))
    seq = policy_loss(logps, old, None, torch.tensor([1.0, 1.0]), mask,
                      LossConfig(0.0, 0.2, 0.2, "grpo", 2, importance="sequence"))
    assert token.clip_ratio == pytest.approx(0.25)  # exp(0.5) > 1.2 on one token
    assert seq.clip_ratio == 0.0  # the sequence's mean log-ratio is 0
    assert seq.loss.item() == pytest.approx(-1.0)


def test_zero_std_groups():
    flags = zero_std_groups(torch.tensor([1.0, 1.0, 0.0, 0.5, 0.2, 0.7]), 3)
    assert flags.tolist() == [False] * 3 + [False] * 3
    assert zero_std_groups(torch.tensor([0.3, 0.3, 0.3, 0.0, 1.0, 0.0]), 3).tolist() == [True] * 3 + [False] * 3


def generating(**overrides):
    values = dict(temperature=0.95, top_p=0.7, top_k=50, repetition_penalty=1.0, max_new_tokens=64, max_length=1024,
                  num_beams=1)
    return SimpleNamespace(**{**values, **overrides})


def test_sampling_defaults_do_not_truncate():
    """Defect 4: LF's chat defaults (top_p 0.7, top_k 50) must not apply to GRPO sampling unless asked for."""
    settings_, notes = sampling_settings(generating(), explicit_keys({"stage": "grpo", "temperature": 0.95}))
    assert settings_ == {"temperature": 0.95, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                         "max_new_tokens": 64}
    assert notes == []
    settings_, notes = sampling_settings(generating(top_p=0.9), explicit_keys(["x.yaml", "top_p=0.9"]))
    assert settings_["top_p"] == 0.9 and settings_["top_k"] == 0
    assert len(notes) == 1 and "top_p=0.9" in notes[0] and "biased" in notes[0]
    assert sampling_settings(generating(top_k=0), {"top_k"})[1] == []
    with pytest.raises(ValueError, match="max_new_tokens > 0"):
        sampling_settings(generating(max_new_tokens=-1), set())
    with pytest.raises(ValueError, match="temperature > 0"):
        sampling_settings(generating(temperature=0.0), set())
    with pytest.raises(ValueError, match="num_beams"):
        sampling_settings(generating(num_beams=4), set())


def test_vision_token_ids(tokenizer):
    ids = vision_token_ids(tokenizer)
    assert len(ids) == 4 and tokenizer.convert_tokens_to_ids("<|image_pad|>") in ids


def test_one_failing_completion_scores_zero_alone():
    """Defect 5: a reward that raises on one completion must not zero the others."""

    def picky(completions, **_):
        if any("bad" in c for c in completions):
            raise RuntimeError("cannot score")
        return [len(c) / 10 for c in completions]

    def nan_one(completions, **_):
        return [float("nan") if c == "b" else 1.0 for c in completions]

    columns = {"references": ["x"] * 3}
    shared = {"resize_policy": None, "coords": "model"}
    values, errors, failure = score(Reward("picky", picky, 1.0), ["aaaa", "bad", "cc"], columns, shared)
    assert values == [0.4, 0.0, 0.2] and errors == [False, True, False]
    assert "on the completion 'bad'" in failure and "RuntimeError: cannot score" in failure  # with its traceback
    scored = score(Reward("n", nan_one, 1.0), ["a", "b", "c"], columns, shared)
    assert scored[:2] == ([1.0, 0.0, 1.0], [False, True, False])
    assert scored.failure == "returned nan for the completion 'b'"
    boom = score(Reward("boom", lambda c, **_: 1 / 0, 1.0), ["a", "b"], {"references": ["x"] * 2}, shared)
    assert boom.errors == [True, True] and "ZeroDivisionError" in boom.failure


def test_legacy_policy_keyword_still_works(tmp_path):
    path = tmp_path / "old_reward.py"
    path.write_text("def old(completions, *, references, policy, coords):\n"
                    "    return [float(policy.factor)] * len(completions)\n"
                    "def new(completions, *, resize_policy, **kw):\n    return [1.0] * len(completions)\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old, new = load_rewards(f"{path}:old,{path}:new", None)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)][0].startswith("reward 'old'")
    assert old.legacy_policy and not new.legacy_policy
    (tmp_path / "kw_reward.py").write_text("def kw(completions, **kw):\n    return [kw['policy'].factor] * len(completions)\n")
    assert score(load_rewards(f"{tmp_path / 'kw_reward.py'}:kw", None)[0], ["a"], {"references": ["x"]},
                 {"resize_policy": SimpleNamespace(factor=28), "coords": "model"}) == ([28.0], [False], None)
    shared = {"resize_policy": SimpleNamespace(factor=28), "coords": "model"}
    columns = {"references": ["x"], "prompts": ["p"], "indices": [0]}  # keywords it does not name are not passed
    assert score(old, ["a"], columns, shared) == ([28.0], [False], None)
    assert score(new, ["a"], {"references": ["x"]}, shared) == ([1.0], [False], None)


def test_vision_tokens_are_cut_from_completions():
    """Defect 6 safety net: a completion that contains a vision placeholder ends before it."""
    ids = torch.tensor([[5, 6, 99, 7, 2], [5, 6, 7, 2, 0]])
    mask, stopped = completion_mask(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]] and stopped.tolist() == [True, True]
    cut_ids, cut_mask, rows = cut_at_tokens(ids, mask, [99, 98], pad_id=0)
    assert rows.tolist() == [True, False]
    assert cut_ids.tolist() == [[5, 6, 0, 0, 0], [5, 6, 7, 2, 0]]
    assert cut_mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    assert not cut_at_tokens(ids, mask, [], 0)[2].any()


@pytest.mark.parametrize("world_size,repeats", [(1, 1), (2, 4), (3, 2)])
def test_rollout_sampler_hands_each_rank_its_own_repeated_chunk(world_size, repeats):
    """Round-robin batch sharding (what accelerate does) must give every rank the same prompts at each micro-step
    of a round and different prompts from the other ranks."""
    per_rank = 2
    sampler = RolloutSampler(13, per_rank, world_size, repeats, seed=3)
    order = list(sampler)
    assert len(order) == len(sampler) == 13 // (per_rank * world_size) * per_rank * world_size * repeats
    batches = [order[i:i + per_rank] for i in range(0, len(order), per_rank)]
    for rank in range(world_size):
        mine = batches[rank::world_size]
        rounds = [mine[i:i + repeats] for i in range(0, len(mine), repeats)]
        assert all(all(b == r[0] for b in r) for r in rounds)
    firsts = [batches[rank] for rank in range(world_size)]
    assert len({i for b in firsts for i in b}) == per_rank * world_size
    sampler.set_epoch(1)
    assert list(sampler) != order
    with pytest.raises(ValueError, match="one generation batch needs 8"):
        RolloutSampler(5, 4, 2, 1)


def test_reference_json_answers_parse(tokenizer):
    answer = json.dumps([{"bbox_2d": [1, 2, 30, 40], "label": "box"}])
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert decode_kept(tokenizer, tokenizer.encode(answer) + [stop], {stop}) == answer


def test_sampler_epoch_follows_the_trainer_state():
    """After a resume accelerate's skip wrapper hides the sampler from ``set_epoch``; the callback sets it."""
    from llamafactory_qwenvl_patch.grpo.trainer.trainer import _SamplerEpoch

    sampler = RolloutSampler(8, 2, 1, 1)
    callback = _SamplerEpoch(SimpleNamespace(rollout_sampler=sampler))
    for epoch, expected in ((None, 0), (0.0, 0), (1.5, 1), (2.9999999, 3), (3.0, 3)):
        callback.on_epoch_begin(None, SimpleNamespace(epoch=epoch), None)
        assert sampler.epoch == expected


def test_run_generation_config_replaces_the_checkpoints_during_generate():
    """transformers 4.55-4.57 fill 'default-looking' values (top_k 50, top_p 1) from ``model.generation_config``;
    while the run's config is the model's own, there is nothing else to fill from."""
    from transformers import GenerationConfig

    from llamafactory_qwenvl_patch.grpo.generation.settings import generation_config_of

    checkpoint = GenerationConfig(do_sample=True, top_k=1, top_p=0.001, temperature=0.1)
    ours = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    model = SimpleNamespace(generation_config=checkpoint)
    with generation_config_of(model, ours):
        assert model.generation_config is ours
    assert model.generation_config is checkpoint
    with pytest.raises(RuntimeError), generation_config_of(model, ours):
        raise RuntimeError("generate failed")
    assert model.generation_config is checkpoint


def test_the_blank_control_takes_prompts_with_images_and_no_videos():
    """A video beside blanked images would still show the scene: such prompts get no blank copy."""
    from llamafactory_qwenvl_patch.grpo.rollout.collate import blankable

    assert blankable({"images": ["a.jpg"]}) and blankable({"images": ["a.jpg"], "videos": []})
    assert not blankable({"images": ["a.jpg"], "videos": ["c.mp4"]})
    assert not blankable({"videos": ["c.mp4"]}) and not blankable({"images": []})
