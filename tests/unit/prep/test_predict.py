"""``qwenvl-prep predict``: batched generation answers as one image at a time does, in each image's own frame."""

from __future__ import annotations

import shutil

import pytest
from helpers import save_image

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record
from qwenvl_prep.pipeline.predict import Predictor


def test_batched_answers_equal_single_ones(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    policy = ResizePolicy(16 * 28 * 28, 64 * 28 * 28)
    write_policy_record(model, policy)
    sizes = [(640, 480), (300, 900), (1000, 1000), (200, 150), (1600, 400)]  # different prompt lengths once padded
    jobs = [(str(save_image(tmp_path / f"i{k}.jpg", w, h)), f"Locate object {k} in the image.")
            for k, (w, h) in enumerate(sizes)]
    predictor = Predictor(model, max_new_tokens=12)
    batched = predictor.batch(jobs)
    single = [predictor(image, prompt) for image, prompt in jobs]
    assert [row["predict"] for row in batched] == [row["predict"] for row in single]
    for row, (w, h) in zip(batched, sizes):
        assert row["orig_size"] == [w, h]
        assert row["model_size"] == list(reversed(policy.model_size(h, w)))


def test_a_lora_adapter_folder_answers_as_its_merged_export(tiny_model, tmp_path):
    """An adapter folder as LF writes it (adapter, its frame's record, no processor) is loaded through peft on its
    local base, in the adapter's frame; the answers equal those of the merged model saved as a whole folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    write_policy_record(base, ResizePolicy(16 * 28 * 28, 32 * 28 * 28))
    adapter_policy = ResizePolicy(32 * 28 * 28, 64 * 28 * 28)  # trained at other bounds: the adapter's frame wins
    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), LoraConfig(
        r=4, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # an adapter that changes the answers
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    write_policy_record(adapter, adapter_policy)
    merged = tmp_path / "merged"
    model.merge_and_unload().save_pretrained(merged)
    AutoProcessor.from_pretrained(base).save_pretrained(merged)
    write_policy_record(merged, adapter_policy)
    jobs = [(str(save_image(tmp_path / f"i{k}.jpg", w, h)), "Locate the box.") for k, (w, h) in
            enumerate([(640, 480), (300, 900)])]
    from_adapter = Predictor(adapter, max_new_tokens=12).batch(jobs)
    from_export = Predictor(merged, max_new_tokens=12).batch(jobs)
    base_rows = Predictor(base, max_new_tokens=12).batch(jobs)
    assert [r["predict"] for r in from_adapter] == [r["predict"] for r in from_export]
    assert [r["predict"] for r in from_adapter] != [r["predict"] for r in base_rows]
    for row, (w, h) in zip(from_adapter, [(640, 480), (300, 900)]):
        assert row["model_size"] == list(reversed(adapter_policy.model_size(h, w)))


def test_an_adapter_without_a_local_base_is_refused_with_the_export_advice(tmp_path):
    import json

    import pytest

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen2.5-VL-7B-Instruct"}))
    with pytest.raises(ValueError, match="not a local model folder: export the merged model"):
        Predictor(adapter)


def test_sampling_repeats_with_its_seed_and_differs_from_greedy(tiny_model, tmp_path):
    """``temperature`` > 0 samples the model's distribution: the same seed gives the same answers, another seed other
    ones, and a random-weight model's samples are not its greedy answers."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    write_policy_record(model, ResizePolicy(16 * 28 * 28, 64 * 28 * 28))
    jobs = [(str(save_image(tmp_path / f"i{k}.jpg", 320, 240)), "Read the invoice as JSON.") for k in range(4)]

    def answers(**sampling):
        return [row["predict"] for row in Predictor(model, max_new_tokens=12, **sampling).batch(jobs)]

    greedy = answers()
    assert len(set(greedy)) == 1  # the same blank-ish image four times: one greedy answer
    first, again, other = answers(temperature=1.0, seed=3), answers(temperature=1.0, seed=3), answers(temperature=1.0,
                                                                                                       seed=4)
    assert first == again and first != other
    assert len(set(first)) > 1 and set(first) != set(greedy)


def refusal(capsys, args: list[str]) -> str:
    """``qwenvl-prep ARGS`` in this process, refused as a usage error (exit 2): its stderr."""
    from qwenvl_prep.cli import main

    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, (code, err)
    return err


def test_a_negative_non_finite_or_vanishing_temperature_is_refused(tiny_model, capsys):
    """1e-300 used to load the model and die in torch's sampling (the scaled logits overflow float32)."""
    for bad in (-0.5, float("nan"), float("inf"), 1e-300, 1e-4):
        with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or a finite number >= 0.001"):
            Predictor(tiny_model, temperature=bad)
    for bad in ("-1", "1e-300"):
        assert "--temperature takes a number 0 or >= 0.001" in refusal(
            capsys, ["predict", str(tiny_model), "--dataset", "x.jsonl", "--temperature", bad])
    # a seed that would change nothing is refused, not silently ignored
    assert "--seed only acts with --temperature > 0" in refusal(
        capsys, ["predict", str(tiny_model), "--dataset", "x.jsonl", "--seed", "3"])


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_qwen3", "tiny_model_qwen2"])
def test_video_answers_in_the_folders_video_policy(request, fixture, tmp_path):
    """Clips (mp4 and webm, mixed with an image in one call) are sampled, sized and clocked by the folder's recorded
    video policy; batched answers equal one-at-a-time ones; a track's boxes come back in the clip's pixels with their
    times as written. Qwen2.5-VL (seconds), Qwen3-VL (stamps) and Qwen2-VL (group index, 0-1000 boxes at factor 28)."""
    from helpers import write_clip

    from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model
    from llamafactory_qwenvl_patch.frame.video import VideoPolicy
    from llamafactory_qwenvl_patch.image_io.video import probe
    from qwenvl_prep.commands.predict import answer_batch

    model = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), model)
    family = FAMILIES[family_of_model(model)]
    video = VideoPolicy(2048, 16384, family.factor, 2.0, 12, family.video_clock)
    write_policy_record(model, ResizePolicy(16 * 28 * 28, 64 * 28 * 28, family.factor), video)
    clips = [str(write_clip(tmp_path / "a.mp4", 3, 10, 160, 90)),
             str(write_clip(tmp_path / "b.webm", 9, 10, 96, 96, codec="libvpx"))]
    image = str(save_image(tmp_path / "i.jpg", 320, 240))
    predictor = Predictor(model, max_new_tokens=8)
    assert predictor.video_policy == video
    jobs = [(clips[0], "When?", None), (image, "Where?", None), (clips[1], "When does it end?", None)]
    rows = answer_batch(predictor, jobs)
    single = [answer_batch(predictor, [job])[0] for job in jobs]
    assert [row["predict"] for row in rows] == [row["predict"] for row in single]
    assert rows[1]["image"] == image and [rows[0]["video"], rows[2]["video"]] == clips
    assert rows[0]["model_size"] == list(reversed(video.frame_size(90, 160))) and rows[0]["orig_size"] == [160, 90]
    long_clip = probe(clips[1], 2.0).plan(video)
    assert rows[0]["frames"] == 6 and rows[2]["frames"] == len(long_clip.indices) <= 12  # 3 s at 2 fps; 9 s capped
    assert rows[2]["frames"] == (10 if family.video_clock == "seconds" else 12)  # Qwen2.5-VL: 1 fps, whole seconds
    model_hw = video.frame_size(90, 160)
    track = '[{"time": 1.5, "bbox_2d": [%d, 0, %d, %d]}]' % ((0, 500, 1000) if family.coords == "rel1000"
                                                             else (0, model_hw[1] // 2, model_hw[0]))
    row = predictor._row(clips[0], "Track it", track, (90, 160), model_hw, key="video")
    assert row["items"][0]["orig"] == [0.0, 0.0, 80.0, 90.0]
    assert '"time": 1.5' in row["predict_orig"] and "80" in row["predict_orig"]


def test_a_records_system_prompt_is_asked_with_it(tiny_model, tmp_path):
    """A record trained under a system prompt (a system turn, as LF reads it) is predicted under it; predict asked the
    user turns alone before. The settings say so, and a preset's own words replace it."""
    import argparse
    import json

    from qwenvl_prep.cli import main
    from qwenvl_prep.commands.predict import dataset_jobs
    from qwenvl_prep.pipeline.predict import Ask

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    policy = ResizePolicy(16 * 28 * 28, 64 * 28 * 28)
    write_policy_record(model, policy)
    save_image(tmp_path / "raw" / "a.jpg", 320, 240)
    turns = [{"role": "user", "content": "<image>Where is it?"},
             {"role": "assistant", "content": '[{"bbox_2d": [10, 10, 50, 50]}]'}]
    records = [{"messages": [{"role": "system", "content": "You are a GUI agent."}, *turns], "images": ["a.jpg"]},
               {"messages": turns, "images": ["a.jpg"]},
               {"messages": [{"role": "system", "content": ""}, *turns], "images": ["a.jpg"]}]  # LF: the default
    (tmp_path / "raw" / "in.json").write_text(json.dumps(records))
    data = tmp_path / "data" / "d.json"
    assert main(["convert", str(tmp_path / "raw" / "in.json"), "-o", str(data), "--input-coords", "abs", "-q",
                 "--min-pixels", str(policy.min_pixels), "--max-pixels", str(policy.max_pixels), "--workers", "1"]) == 0
    args = argparse.Namespace(dataset=data, model_dir=model, prompt_preset=None)
    jobs, _, _ = dataset_jobs(args)
    assert [prompt for _, prompt, _ in jobs] == [Ask("Where is it?", "You are a GUI agent."), "Where is it?",
                                                 "Where is it?"]
    predictor = Predictor(model, max_new_tokens=4)
    with_system = predictor.prompt_text(jobs[0][1], (224, 308))
    assert with_system.startswith("<|im_start|>system\nYou are a GUI agent.<|im_end|>\n")
    assert predictor.prompt_text(jobs[1][1], (224, 308)).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")  # the template's default, as LF's
    out = tmp_path / "p.jsonl"
    assert main(["predict", str(model), "--dataset", str(data), "-o", str(out), "--max-new-tokens", "4"]) == 0
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["Where is it?"] * 3
    settings = json.loads(out.with_name(out.name + ".settings.json").read_text())
    assert settings["prompt"] == "the dataset's own prompts, under their system prompts"


def test_draw_refuses_clips_before_loading(tiny_model, tmp_path, capsys):
    """No model is loaded for a request that cannot be answered as asked: --draw of a clip (it draws on images)."""
    from helpers import write_clip

    clip = write_clip(tmp_path / "a.mp4", 2, 10, 64, 48)
    assert "draw DATA --predictions" in refusal(
        capsys, ["predict", str(tiny_model), str(clip), "--prompt", "When?", "--draw", str(tmp_path / "drawn")])
    assert not (tmp_path / "drawn").exists()


def test_a_dataset_whose_video_frame_differs_is_refused(tiny_model, tmp_path):
    """Model-pixel answers (Qwen2.5-VL) are read in the dataset's frame: a dataset converted in another video frame
    than the folder answers in is refused, a folder without a video record answering in LF's defaults."""
    from llamafactory_qwenvl_patch.frame.stamp import Stamp
    from llamafactory_qwenvl_patch.frame.video import VideoPolicy
    from qwenvl_prep.pipeline.predict import dataset_frame_problem

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    policy = ResizePolicy(16 * 28 * 28, 64 * 28 * 28)
    write_policy_record(model, policy)  # no video policy: LF's defaults
    default = VideoPolicy.from_lf_keys({}, 28, "seconds")
    assert dataset_frame_problem(model, Stamp(policy, "model", "qwen2_5_vl", video=default)) is None
    other = VideoPolicy(2048, 16384, 28, default.fps, default.max_frames, "seconds")
    assert "video frame 2048..16384 pixels" in dataset_frame_problem(model, Stamp(policy, "model", "qwen2_5_vl",
                                                                                   video=other))
    write_policy_record(model, policy, other)
    assert dataset_frame_problem(model, Stamp(policy, "model", "qwen2_5_vl", video=other)) is None
    assert "frame 3136..50176" in dataset_frame_problem(model, Stamp(ResizePolicy(3136, 50176), "model", "qwen2_5_vl"))
