"""Issue 49, item 6: one video dataset through the whole chain, on small Qwen2.5-VL and Qwen3-VL. A Charades-STA file
as the dataset ships it -> ``qwenvl-prep convert --format charades-sta`` -> SFT -> GRPO (vLLM rollouts, shared
prefix) -> ``llamafactory-cli export`` -> ``qwenvl-prep predict --backend vllm`` -> ``qwenvl-prep eval`` -> vLLM's
OpenAI server (``vllm_video_request``) and LF's API: every stage in the converted stamp's video frame, clock and
positions. One CLI run per stage, each checked several ways. It pays for itself with what the other video tests
build: the video demo's clips and stage YAMLs (``demos.video``, ``demos.steps``), the session's small models, and
the servers of ``test_vllm_serve`` and ``test_serving``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import read_log, run_cli, video_structure

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from qwenvl_prep.demos.steps import full_training, grpo_stage, sft_stage, write_yaml
from qwenvl_prep.demos.video import MAX_PIXELS, MIN_PIXELS, VIDEO_KEYS, synthesise

pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MODELS = {"qwen2_5_vl": "small_model", "qwen3_vl": "small_model_qwen3"}  # conftest's session models
CLIPS, SFT_STEPS, GRPO_STEPS = 4, 40, 2


@pytest.fixture(scope="module")
def charades(tmp_path_factory) -> tuple[Path, Path]:
    """The video demo's clips (a square crossing a noisy 96x64 frame between two whole seconds, 8 s at 8 fps) named as
    Charades-STA names them (``VID.mp4``), and their file as the dataset ships it: ``VID START END##sentence``. Seed
    2 draws four colours, so a short SFT memorises most spans from the query (answers that parse and score)."""
    raw = tmp_path_factory.mktemp("charades")
    entries = synthesise(raw, CLIPS, seed=2)
    assert len({e["query"] for e in entries}) == CLIPS
    lines = [f"{Path(e['video']).stem} {e['timestamp'][0]:.1f} {e['timestamp'][1]:.1f}##{e['query']}."
             for e in entries]
    (raw / "charades_sta_train.txt").write_text("\n".join(lines) + "\n")
    return raw / "charades_sta_train.txt", raw / "clips"


def recorded_video(folder: Path, keys: dict) -> dict:
    """A checkpoint's or export's recorded video policy, on the keys of a dataset stamp's (a record adds the
    frame-list rate)."""
    video = json.loads((folder / "qwenvl_policy.json").read_text())["video"]
    return {key: video[key] for key in keys}


def hf_prompt(export: Path, clip: str, prompt: str):
    """The HF side of a served clip: transformers' processor under the export's recorded policy (what predict's HF
    backend feeds the model) and the pinned model's log-prob of each prompt token after the first."""
    import torch

    from qwenvl_prep.pipeline.predict import Predictor

    predictor = Predictor(export)
    inputs = predictor.processor_inputs(predictor.read_clips([(clip, prompt)], None))
    with torch.no_grad():
        logits = predictor.model(**inputs).logits[0, :-1].float()
    ids = inputs["input_ids"][0]
    return ids.tolist(), torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("family", list(MODELS))
def test_charades_sta_through_the_whole_chain(request, family, charades, tmp_path):
    import torch
    from test_serving import Server
    from test_vllm_serve import serve

    from llamafactory_qwenvl_patch.image_io.video import probe
    from llamafactory_qwenvl_patch.image_io.video_request import vllm_video_request
    from llamafactory_qwenvl_patch.scoring.temporal import parse_spans, recall_at_1, try_parse_spans

    source, clips = charades
    f = FAMILIES[family]
    video = VideoPolicy.from_lf_keys(VIDEO_KEYS, f.factor, f.video_clock)
    data = tmp_path / "data"
    common = {**full_training(family, data, "charades", ResizePolicy(MIN_PIXELS, MAX_PIXELS, f.factor)),
              **VIDEO_KEYS, "preprocessing_num_workers": 1, "dataloader_num_workers": 0}
    sft_yaml = write_yaml(tmp_path / "sft.yaml", {**sft_stage(common, request.getfixturevalue(MODELS[family]),
                                                              tmp_path / "sft", SFT_STEPS, 4),
                                                  "learning_rate": 5e-3, "disable_gradient_checkpointing": True})

    def stage(name: str, args: list[str], config: dict | None = None):
        result = run_cli(args, config, tmp_path / f"{name}-run", timeout=900)
        assert result.returncode == 0, f"{name}:\n{result.stderr[-4000:]}"
        return result

    # convert: the Charades-STA file into the SFT YAML's video frame and clock, its times as the file writes them
    converted = data / "charades.json"
    stage("convert", ["qwenvl-prep", "convert", str(source), "-o", str(converted), "--format", "charades-sta",
                      "--video-dir", str(clips), "--from-yaml", str(sft_yaml), "-q", "--workers", "1"])
    stamp = json.loads((data / "dataset_info.json").read_text())["charades"]["qwenvl_policy"]
    assert stamp["video"] == video.to_dict() and stamp["family"] == family
    records = json.loads(converted.read_text())
    lines = source.read_text().splitlines()
    assert len(records) == len(lines) == CLIPS
    for record, line in zip(records, lines):
        vid, start, end = line.split("##")[0].split()
        assert Path(record["videos"][0]).name == f"{vid}.mp4"
        assert json.loads(record["messages"][1]["content"]) == {"span": [float(start), float(end)]}
        assert f"{start}, {end}" in record["messages"][1]["content"]  # as written: "2.0" stays "2.0"

    # SFT and GRPO (vLLM rollouts on the shared prefix): each checkpoint records the stamp's video policy; vLLM's
    # log-probs of the sampled answers are the training forward's (the same frames, clock and positions)
    stage("sft", ["llamafactory-cli", "train", str(sft_yaml)])
    assert recorded_video(tmp_path / "sft", stamp["video"]) == stamp["video"]
    sft_loss = [row["loss"] for row in read_log(tmp_path / "sft") if "loss" in row]
    assert sft_loss[-1] < sft_loss[0] / 10, sft_loss  # it learned the answers, so later stages see real spans
    grpo = {**grpo_stage(common, tmp_path / "sft", tmp_path / "grpo", "charades", "tiou,format", GRPO_STEPS, 16),
            "per_device_train_batch_size": 2, "grpo_num_generations": 2, "grpo_rollout_backend": "vllm",
            "grpo_shared_prefix": True}
    log = stage("grpo", ["llamafactory-cli", "train"], grpo)
    assert "grpo_shared_prefix: on" in log.stdout + log.stderr
    steps = [row for row in read_log(tmp_path / "grpo") if "reward" in row]
    assert len(steps) == GRPO_STEPS and all(row["vllm/logp_diff/mean"] < 1e-3 for row in steps), steps
    assert recorded_video(tmp_path / "grpo", stamp["video"]) == stamp["video"]

    # export: the folder alone decides the video frame and clock from here on
    export = tmp_path / "export"
    stage("export", ["llamafactory-cli", "export"], {"model_name_or_path": str(tmp_path / "grpo"),
                                                      "template": f.default_template, "export_dir": str(export),
                                                      "infer_dtype": "float32"})
    assert recorded_video(export, stamp["video"]) == stamp["video"]

    # predict on vLLM: each clip in the converted labels' frame (the stamp's frame size), frame count and duration
    predictions = tmp_path / "predictions.jsonl"
    stage("predict", ["qwenvl-prep", "predict", str(export), "--dataset", str(converted), "--backend", "vllm",
                      "--max-new-tokens", "16", "-o", str(predictions)])
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert [row["video"] for row in rows] == [record["videos"][0] for record in records]
    for row, record in zip(rows, records):
        probed = probe(row["video"], video.fps)
        assert row["model_size"] == list(reversed(video.frame_size(probed.height, probed.width)))
        assert row["orig_size"] == [probed.width, probed.height]
        assert row["frames"] == len(probed.plan(video).indices) == video.frame_cap  # 8 s at 2 fps: 16 frames
        assert row["duration"] == round(json.loads(record["meta"])["duration"], 3)

    # eval: the answers scored against the labels in the same clock (its mean tIoU is ours from the rows)
    scores = tmp_path / "eval.json"
    stage("eval", ["qwenvl-prep", "eval", str(converted), "--predictions", str(predictions), "--json-out",
                   str(scores)])
    spans = json.loads(scores.read_text())["spans"]
    ours = [recall_at_1(parse_spans(record["messages"][1]["content"]), try_parse_spans(row["predict"]) or [])
            for row, record in zip(rows, records)]
    assert spans["samples"] == CLIPS and spans["mean_tiou"] == pytest.approx(sum(ours) / CLIPS, abs=1e-6)
    assert spans["parse_failure_rate"] < 1 and sum(ours) > 0  # scored answers, not a column of parse failures

    # vLLM's OpenAI server, the clip sent with vllm_video_request: the prompt is token for token the HF processor's
    # under the recorded policy (frames, stamps), and its log-probs are the pinned HF model's (pixels, positions)
    clip, prompt = rows[0]["video"], rows[0]["prompt"]
    ids, logprobs = hf_prompt(export, clip, prompt)
    server = serve(Path(sys.executable), export, tmp_path)
    try:
        part, extra = vllm_video_request(clip, export)
        answer = server.client.chat.completions.create(
            model=server.model, temperature=0, max_tokens=16, messages=[{"role": "user", "content": [
                part, {"type": "text", "text": prompt}]}], extra_body={**extra, "prompt_logprobs": 0})
    finally:
        server.stop()
    served = answer.model_extra["prompt_logprobs"][1:]
    assert answer.usage.prompt_tokens == len(ids)
    assert [int(next(iter(entry))) for entry in served] == ids[1:]
    gap = (torch.tensor([next(iter(entry.values()))["logprob"] for entry in served]) - logprobs).abs().max()
    assert gap < 1e-3, gap
    assert answer.choices[0].message.content == rows[0]["predict"]  # predict's vLLM engine, the same answer

    # LF's API (HF engine), no video key in its YAML: the clip's prompt holds exactly the recorded policy's structure
    server = Server(tmp_path / "api", {"model_name_or_path": str(export), "template": f.default_template,
                                       "infer_backend": "huggingface"}, clips)
    try:
        def tokens(content: list) -> int:
            return server.client.chat.completions.create(model="test", temperature=0, max_tokens=1, messages=[
                {"role": "user", "content": content}]).usage.prompt_tokens

        text_only = tokens([{"type": "text", "text": prompt}])
        with_video = tokens([{"type": "video_url", "video_url": {"url": clip}}, {"type": "text", "text": prompt}])
    finally:
        server.stop()
    from transformers import AutoTokenizer

    structure = AutoTokenizer.from_pretrained(export)(video_structure(export, Path(clip)), add_special_tokens=False)
    assert with_video == text_only + len(structure["input_ids"])
    assert "and its video policy" in server.logfile.read_text()
