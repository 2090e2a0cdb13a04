"""GRPO on video prompts: the shared prefix (each prompt and its videos encoded once per group) equals the repeated
layout on Qwen2.5-VL (``second_per_grid_ts`` repeated with its videos), Qwen3-VL and the hybrid Qwen3.5 (stamps in
the prompt), in per-token log-probs, gradients and a whole optimiser step, for prompts of different lengths with one
or two clips of different sizes and lengths. The prompts come from the pinned plugin's own video path, as LF's
collator builds them under ``qwenvl_patch: true``."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_grpo_shared_prefix as shared_tests
import torch
from helpers import write_clip

from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.grpo.rollout.tensors import videos_per_sample

# clips of each prompt: (seconds, fps, width, height); prompt 4 has two
CLIPS = [[(2.0, 10, 96, 64)], [(3.0, 8, 64, 96)], [(1.0, 10, 80, 80)], [(4.0, 5, 128, 72)],
         [(1.5, 10, 64, 64), (2.5, 10, 112, 64)]]
TEMPLATES = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl_nothink", "qwen3_5": "qwen3_5_nothink"}
FIXTURES = {"qwen2_5_vl": "tiny_model", "qwen3_vl": "tiny_model_qwen3", "qwen3_5": "tiny_model_qwen3_5"}

pytestmark = pytest.mark.slow  # tiny models' forward and backward passes, twice per case


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory) -> list[list[Path]]:
    folder = tmp_path_factory.mktemp("grpo-clips")
    return [[write_clip(folder / f"p{i}-{k}.mp4", *clip) for k, clip in enumerate(clips)]
            for i, clips in enumerate(CLIPS)]


def pinned(model_dir: Path):
    """The pinned LF plugin of this family (what the template patch installs), with a small video frame."""
    from llamafactory.data.template import TEMPLATES as LF_TEMPLATES

    from llamafactory_qwenvl_patch.integration.plugin import pinned_plugin

    family = FAMILIES[family_of_model(model_dir)]
    video = VideoPolicy(2048, 12288, family.factor, 4.0, 16, family.video_clock)
    plugin = LF_TEMPLATES[TEMPLATES[family.name]].mm_plugin
    return pinned_plugin(plugin, ResizePolicy(3136, 50176, family.factor), video, 2.0)


def video_prompts(clip_files):
    """A ``prompt_batch`` for ``test_grpo_shared_prefix``'s trainer: left-padded prompts whose videos went through
    the pinned plugin (frames, count, clock and token expansion)."""
    def build(processor, indices: list[int]) -> dict[str, torch.Tensor]:
        plugin = build.plugin
        texts, videos = [], []
        for i in indices:
            clips = [str(path) for path in clip_files[i]]
            content = "<video>" * len(clips) + shared_tests.QUESTIONS[i]
            message = plugin.process_messages([{"role": "user", "content": content}], [], clips, [], processor)[0]
            texts.append(processor.tokenizer.apply_chat_template(
                [{"role": "user", "content": message["content"]}], tokenize=False, add_generation_prompt=True))
            videos += clips
        batch = dict(processor.tokenizer(texts, return_tensors="pt", padding=True))
        mm = plugin._get_mm_inputs([], videos, [], processor)
        batch.update({k: mm[k] for k in ("pixel_values_videos", "video_grid_thw")})
        if "second_per_grid_ts" in mm:  # as the trainer's _collate hands it on (LF's collator gives a list)
            batch["second_per_grid_ts"] = torch.as_tensor(mm["second_per_grid_ts"], dtype=torch.float32)
        return batch

    return build


@pytest.fixture()
def video_trainer(request, clip_files, monkeypatch, tmp_path):
    """``test_grpo_shared_prefix``'s trainer factory on video prompts of one family."""
    def make(family: str, mode: str, shared: str, folder: Path):
        model_dir = request.getfixturevalue(FIXTURES[family])
        build = video_prompts(clip_files)
        build.plugin = pinned(model_dir)
        monkeypatch.setattr(shared_tests, "prompt_batch", build)
        return shared_tests.make_trainer(model_dir, shared_tests.MODES[mode], shared, folder)

    return make


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("family", FIXTURES)
def test_video_log_probs_and_gradients_match_the_repeated_layout(video_trainer, family, mode, tmp_path):
    trainer, processor = video_trainer(family, mode, "true", tmp_path)
    batch = shared_tests.prompt_batch(processor, [0, 4, 1, 2])
    assert videos_per_sample(batch["input_ids"], trainer.video_id, batch["video_grid_thw"],
                             trainer.video_merge_length) == [1, 2, 1, 1]
    if family == "qwen2_5_vl":
        assert len(batch["second_per_grid_ts"]) == 5 and all(v == int(v) for v in batch["second_per_grid_ts"])
    shared = shared_tests.logps_and_grads(trainer, processor, [0, 4, 1, 2])
    trainer.shared_prefix = False
    repeated = shared_tests.logps_and_grads(trainer, processor, [0, 4, 1, 2])
    mask = repeated[1]
    assert (shared[0] - repeated[0]).abs()[mask].max() <= 1e-5
    shared_tests.assert_close_grads(shared[2], repeated[2])
    if shared_tests.MODES[mode]["vision"]:
        assert any(".visual." in name for name in repeated[2])


@pytest.mark.parametrize("family", FIXTURES)
def test_video_optimiser_step_matches_the_repeated_layout(video_trainer, family, tmp_path):
    """Batch 2 x accumulation 2 on video prompts: the parameter moves under SGD are equal."""
    deltas = {}
    for setting in ("true", "false"):
        trainer, _ = video_trainer(family, "lora", setting, tmp_path / setting)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
        deltas[setting] = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if p.requires_grad}
    moved = {n: d for n, d in deltas["false"].items() if d.abs().max() > 0}
    assert moved
    shared_tests.assert_close_grads({n: deltas["true"][n] for n in moved}, moved)


@pytest.mark.parametrize("shared", ["true", "false"])
def test_hf_rollouts_sample_video_prompts(video_trainer, shared, tmp_path):
    """The trainer's own sampling (HF ``generate`` with G return sequences, or the shared-prefix sampler) on video
    prompts of Qwen2.5-VL, whose ``second_per_grid_ts`` generate expands with the prompts."""
    from llamafactory_qwenvl_patch.grpo.trainer.trainer import GRPOTrainer

    trainer, processor = video_trainer("qwen2_5_vl", "lora", shared, tmp_path)
    batch = trainer._prepare_input(shared_tests.prompt_batch(processor, [0, 4]))
    ids = GRPOTrainer._generate(trainer, trainer.model, batch, trainer.generation_config)
    assert ids.shape[0] == 2 * shared_tests.G


def test_each_video_is_encoded_once_per_group(video_trainer, tmp_path):
    trainer, processor = video_trainer("qwen2_5_vl", "lora", "true", tmp_path)
    calls = shared_tests.VisionCalls(shared_tests.shared_prefix.hf_model(trainer.model))
    shared_tests.logps_and_grads(trainer, processor, [0, 4])
    assert calls.images == 3 and calls.first_rows == 2  # three clips in two packed rows, not 2 x G
