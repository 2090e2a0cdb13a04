"""Shared-prefix GRPO equals the repeated layout: per-token log-probs (fp32, atol 1e-5), gradients (relative 1e-4)
and a whole optimiser step through the real GRPOTrainer, on tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL models, with
prompts of different lengths (mixed image sizes, left padding), completions of different lengths, LoRA and full
fine-tuning, the vision tower trainable and frozen, gradient checkpointing (reentrant, as LF sets it, and not),
gradient accumulation 2 and a KL reference. HF rollouts prefill each prompt once and sample what ``generate``
samples. Only sampling is fixed in the step tests (chosen completions), so both layouts optimise the same data."""

from __future__ import annotations

import logging
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from llamafactory_qwenvl_patch.frame.mrope import needs_token_types, token_types
from llamafactory_qwenvl_patch.grpo.generation.hf import sample_shared_prefix
from llamafactory_qwenvl_patch.grpo.generation.settings import generation_config_of, vision_token_ids
from llamafactory_qwenvl_patch.grpo.rewards.registry import Reward
from llamafactory_qwenvl_patch.grpo.rollout import shared_prefix
from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta
from llamafactory_qwenvl_patch.grpo.trainer.trainer import GRPOTrainer
from llamafactory_qwenvl_patch.model_files.experts import folder_experts_load_kwargs

G = 3
# (width, height) of each prompt's images: five frames, five prompt lengths; prompt 4 has two images
SIZES = [[(300, 200)], [(520, 500)], [(200, 610)], [(340, 340)], [(250, 250), (420, 180)]]
QUESTIONS = ["Where is the cat?", "Find the red box, please.", "Box?", "Locate every dog in this picture now.",
             "Which of the two images shows the box?"]
# completion lengths before the stop token, per prompt (0: the stop token alone)
LENGTHS = [[7, 2, 5], [1, 6, 3], [4, 4, 0], [6, 3, 2], [5, 0, 2]]
MODES = {
    # full fine-tuning with a separate frozen reference, vision tower trained, non-reentrant checkpointing
    "full": dict(lora=False, vision=True, checkpointing={"use_reentrant": False}),
    # full fine-tuning, vision tower frozen, no checkpointing
    "full-frozen-vision": dict(lora=False, vision=False, checkpointing=None),
    # LoRA on the language model (the reference is the model without the adapter), reentrant checkpointing as LF
    "lora": dict(lora=True, vision=False, checkpointing={"use_reentrant": True}),
    # the same with eager attention (the shared prefix computes it with SDPA: same math, other rounding)
    "lora-eager": dict(lora=True, vision=False, checkpointing={"use_reentrant": True}, attention="eager"),
}


FIXTURES = {"qwen2_vl": "tiny_model_qwen2", "qwen2_5_vl": "tiny_model", "qwen3_vl": "tiny_model_qwen3",
            "qwen3_5": "tiny_model_qwen3_5", "qwen3_5_moe": "tiny_model_qwen3_5_moe"}


@pytest.fixture()
def families(request):
    """The tiny model of each family, built when a test first asks for it (a family the installed transformers
    lacks skips that test only)."""
    class Models(dict):
        def __missing__(self, name: str):
            return self.setdefault(name, request.getfixturevalue(FIXTURES[name]))

    return Models()


def noise(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt_batch(processor, indices: list[int]) -> dict[str, torch.Tensor]:
    """What LF's collator hands the trainer: left-padded prompts with their images, mixed sizes."""
    def chat(i):
        images = [{"type": "image"} for _ in SIZES[i]]
        return [{"role": "user", "content": [*images, {"type": "text", "text": QUESTIONS[i]}]}]

    texts = [processor.apply_chat_template(chat(i), add_generation_prompt=True) for i in indices]
    images = [noise(*size, seed=10 * i + k) for i in indices for k, size in enumerate(SIZES[i])]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}


def completions(tokenizer, indices: list[int]) -> torch.Tensor:
    """G completions per prompt of the given lengths, each ending with the stop token, right-padded."""
    stop, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    rows = []
    for i in indices:
        for j, n in enumerate(LENGTHS[i]):
            rows.append([int(t) for t in torch.randint(20, 300, (n,), generator=torch.Generator().manual_seed(
                i * 10 + j))] + [stop])
    width = max(map(len, rows))
    return torch.tensor([row + [pad] * (width - len(row)) for row in rows])


def load(model_dir, mode: dict):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                        attn_implementation=mode.get("attention", "sdpa"),
                                                        **folder_experts_load_kwargs(model_dir))
    if mode["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=(
            r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z|"
            r"in_proj_b|in_proj_a|out_proj)")))
    elif not mode["vision"]:
        for param in model.model.visual.parameters():
            param.requires_grad_(False)
    if mode["checkpointing"] is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=mode["checkpointing"])
        if mode["checkpointing"]["use_reentrant"]:
            model.enable_input_require_grads()  # what LF does for reentrant checkpointing
    return model


def make_trainer(model_dir, mode: dict, shared: str, tmp_path, batch: int = 2, accumulation: int = 2):
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainingArguments

    processor = AutoProcessor.from_pretrained(model_dir, padding_side="left")
    tokenizer = processor.tokenizer
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)  # the same LoRA initialisation for both layouts
    model = load(model_dir, mode)
    ref_model = None
    if not mode["lora"]:
        ref_model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=torch.float32, **folder_experts_load_kwargs(model_dir)).eval()
    args = TrainingArguments(output_dir=str(tmp_path / shared), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
                             lr_scheduler_type="constant", max_grad_norm=1e9, use_cpu=True, report_to="none",
                             save_strategy="no", logging_steps=1, seed=0)
    finetuning = SimpleNamespace(
        grpo_num_generations=G, grpo_steps_per_generation=None, grpo_num_iterations=1, grpo_beta=0.04,
        grpo_epsilon=0.2, grpo_epsilon_high=0.2, grpo_loss_type="grpo", grpo_scale_rewards="group",
        grpo_skip_zero_std_groups=False, grpo_mask_truncated=False, grpo_importance_sampling="token",
        grpo_log_completions=False, grpo_blank_image_ratio=0.0, grpo_blank_image_penalty=1.0,
        grpo_shared_prefix=shared, grpo_stop_on_reward_failure=True,
        grpo_advantage_estimator="grpo", grpo_cispo_cap=5.0, grpo_delta=None, grpo_entropy_coef=0.0,
        grpo_overlong_buffer=None, grpo_dynamic_sampling=False, grpo_max_resample=4)

    def reward(completions, **_):
        return [len(c) / 10 + (zlib.crc32(c.encode()) % 7) / 7 for c in completions]  # the same in every process

    trainer = GRPOTrainer(
        model=model, args=args, train_dataset=[{"grpo_index": i} for i in range(4)],
        data_collator=lambda features: {"grpo_features": features}, finetuning_args=finetuning,
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "max_new_tokens": 9},
        reward_funcs=[Reward("spread", reward, 1.0)], ref_model=ref_model, resize_policy=None, coords="model",
        stop_token_ids=[stop], suppress_token_ids=vision_token_ids(tokenizer), processor=processor,
        tokenizer=tokenizer)
    assert trainer.shared_prefix == (shared == "true")

    def collate(features):
        indices = [int(f["grpo_index"]) for f in features]
        batch = trainer._prepare_input(prompt_batch(processor, indices))
        batch["indices"] = indices
        return batch, [SampleMeta(i, "", "", None) for i in indices]

    def generate(model, batch, config):
        return completions(tokenizer, batch["indices"])

    trainer._collate, trainer._generate = collate, generate
    return trainer, processor


def logps_and_grads(trainer, processor, indices: list[int]):
    """The trainer's per-token log-probs of fixed completions and the gradient of their masked sum. The second
    completion is cut to nothing (what ``cut_at_tokens`` does to a row that starts with a vision token)."""
    batch = prompt_batch(processor, indices)
    ids = completions(processor.tokenizer, indices)
    ids[1] = processor.tokenizer.pad_token_id
    mask = (ids != processor.tokenizer.pad_token_id).long()
    trainer.model.train()
    trainer.model.zero_grad()
    with trainer._shared_attention():
        logps = trainer._token_logps(trainer.model, trainer._forward_inputs(batch, ids, mask), ids)[0]
        (logps * mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return logps.detach(), mask.bool(), grads


def assert_close_grads(shared: dict, repeated: dict) -> None:
    """Relative 1e-4 as a whole and per parameter, a parameter's error floored at 1e-6 of the whole gradient (a
    tensor whose own gradient nearly cancels out keeps float rounding of the size of the terms that cancel). LoRA's
    A matrices get exactly zero gradients while B is zero: so must ours."""
    assert shared.keys() == repeated.keys()
    assert sum(grad.norm() > 0 for grad in repeated.values()) >= len(repeated) / 2
    total = torch.cat([grad.flatten() for grad in repeated.values()]).norm()
    error = torch.cat([(shared[name] - grad).flatten() for name, grad in repeated.items()]).norm()
    assert error <= 1e-4 * total
    for name, grad in repeated.items():
        assert (shared[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-6 * total, name


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FIXTURES)
def test_log_probs_and_gradients_match_the_repeated_layout(families, family, mode, tmp_path):
    """Four prompts of four lengths (one with two images), completions of 0-7 tokens, one cut to nothing."""
    trainer, processor = make_trainer(families[family], MODES[mode], "true", tmp_path)
    shared = logps_and_grads(trainer, processor, [0, 4, 1, 2])
    trainer.shared_prefix = False  # the same model and trainer, the repeated layout
    repeated = logps_and_grads(trainer, processor, [0, 4, 1, 2])
    mask = repeated[1]
    assert (shared[0] - repeated[0]).abs()[mask].max() <= 1e-5
    assert_close_grads(shared[2], repeated[2])
    if MODES[mode]["vision"]:
        assert any(".visual." in name for name in repeated[2])


@pytest.mark.parametrize("mode", ["full", "full-frozen-vision", "lora"])
@pytest.mark.parametrize("family", FIXTURES)
def test_optimiser_step_matches_the_repeated_layout(families, family, mode, tmp_path):
    """One step of batch 2 x accumulation 2 (four prompts, four frames): rollout bookkeeping, old and reference
    log-probs, the loss and transformers' accumulation, SGD; the parameter moves equal."""
    deltas = {}
    for setting in ("true", "false"):
        trainer, _ = make_trainer(families[family], MODES[mode], setting, tmp_path / setting)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
        deltas[setting] = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert trainer.state.log_history[0]["kl"] >= 0
    moved = {n: d for n, d in deltas["false"].items() if d.abs().max() > 0}
    assert moved
    assert_close_grads({n: deltas["true"][n] for n in moved}, moved)


class VisionCalls:
    """Counts the images the vision tower encodes and the rows of the language model's first (prefill) call."""

    def __init__(self, model) -> None:
        self.images = 0
        self.first_rows: int | None = None
        model.model.visual.register_forward_pre_hook(self._vision, with_kwargs=True)
        shared_prefix.language_model(model).register_forward_pre_hook(self._language, with_kwargs=True)

    def _vision(self, module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        self.images += len(grid)

    def _language(self, module, args, kwargs):
        if self.first_rows is None:
            self.first_rows = kwargs["inputs_embeds"].size(0)


@pytest.mark.parametrize("family", FIXTURES)
def test_rollout_prefills_once_and_samples_what_generate_samples(families, family):
    """Greedy answers equal generate's; sampled completions equal generate's draw for draw with the same seed
    (same logits processors: repetition penalty, suppressed vision tokens, top-p); the images are encoded once per
    prompt and the prompt prefilled once, where generate encodes and prefills them G times."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

    model = AutoModelForImageTextToText.from_pretrained(
        families[family], dtype=torch.float32, **folder_experts_load_kwargs(families[family])).eval()
    processor = AutoProcessor.from_pretrained(families[family], padding_side="left")
    tokenizer = processor.tokenizer
    batch = prompt_batch(processor, [0, 1, 3])
    if needs_token_types(model):
        batch["mm_token_type_ids"] = token_types(batch["input_ids"], model.config)
    common = dict(eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>")], pad_token_id=tokenizer.pad_token_id,
                  use_cache=True, suppress_tokens=vision_token_ids(tokenizer), max_new_tokens=12)
    configs = [GenerationConfig(do_sample=False, num_return_sequences=1, repetition_penalty=1.3, **common),
               GenerationConfig(do_sample=True, num_return_sequences=4, temperature=1.0, top_p=0.9, top_k=0,
                                **common)]
    for config in configs:
        rows = 3 * config.num_return_sequences
        with torch.no_grad(), generation_config_of(model, config):
            torch.manual_seed(7)
            expected = model.generate(**batch, generation_config=config)[:, batch["input_ids"].size(1):]
            torch.manual_seed(7)
            calls = VisionCalls(model)
            got = sample_shared_prefix(model, batch, config)
        assert got.shape == expected.shape and got.size(0) == rows
        assert torch.equal(got, expected), config.do_sample
        assert calls.images == 3 and calls.first_rows == 3


def test_training_pass_encodes_each_image_once(tiny_model, tmp_path):
    trainer, processor = make_trainer(tiny_model, MODES["lora"], "true", tmp_path)
    calls = VisionCalls(shared_prefix.hf_model(trainer.model))
    logps_and_grads(trainer, processor, [0, 1])
    assert calls.images == 2 and calls.first_rows == 2  # two packed rows, not 2 x G


def test_settings(tiny_model, caplog):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model)
    assert shared_prefix.resolve("auto", [model]) and shared_prefix.resolve("true", [model])
    assert not shared_prefix.resolve("false", [model])
    shared_prefix.language_model(model).config._attn_implementation = "flash_attention_2"
    with caplog.at_level(logging.INFO, logger="llamafactory.qwenvl_patch.grpo"):
        assert not shared_prefix.resolve("auto", [model])
    assert "grpo_shared_prefix: off" in caplog.text and "flash_attention_2" in caplog.text
    with pytest.raises(ValueError, match="grpo_shared_prefix: true cannot apply.*flash_attention_2"):
        shared_prefix.resolve("true", [model])
    with pytest.raises(ValueError, match="no model.language_model"):
        shared_prefix.resolve("true", [torch.nn.Linear(2, 2)])


def test_hybrid_settings_fall_back_loudly_where_a_layer_cannot_be_exact(tiny_model_qwen3_5, caplog):
    """Qwen3.5's Gated DeltaNet layers are exact, so auto and true turn the shared prefix on; where a linear layer
    lacks what the packed forward reads (a transformers that renamed it) or a layer kind is unknown, auto falls back
    with one line naming it and true is an error at start: never a silently wrong log-prob."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_qwen3_5)
    assert shared_prefix.resolve("auto", [model]) and shared_prefix.resolve("true", [model])
    decoder = shared_prefix.language_model(model)
    del decoder.layers[0].linear_attn.chunk_gated_delta_rule
    with caplog.at_level(logging.INFO, logger="llamafactory.qwenvl_patch.grpo"):
        assert not shared_prefix.resolve("auto", [model])
    assert caplog.text.count("grpo_shared_prefix: off") == 1 and "chunk_gated_delta_rule" in caplog.text
    with pytest.raises(ValueError, match="true cannot apply.*Qwen3_5GatedDeltaNet has no chunk_gated_delta_rule"):
        shared_prefix.resolve("true", [model])
    other = AutoModelForImageTextToText.from_pretrained(tiny_model_qwen3_5)
    shared_prefix.language_model(other).config.layer_types[0] = "sliding_attention"
    with pytest.raises(ValueError, match="sliding_attention, which the shared prefix does not reproduce"):
        shared_prefix.resolve("true", [other])
