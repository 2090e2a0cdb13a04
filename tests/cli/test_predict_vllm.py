"""``qwenvl-prep predict --backend vllm`` (issue 43, items 1-2): offline vLLM in the folder's recorded frame gives
the HF backend's greedy answers, token for token, and the same frame (image tokens, model size, boxes mapped to
original pixels) on mixed image sizes, for Qwen2.5-VL, Qwen3-VL and Qwen2-VL (``--size small``: vLLM's CPU attention
needs its heads), and on clips of each (Qwen3-VL: the same frames, groups and stamps; Qwen2.5-VL: the same frames and
seconds per group; Qwen2/2.5-VL: the text after the video where the HF backend's pinned model puts it; issue 49); an
adapter folder is refused. ``agent-eval --backend vllm`` plays the HF backend's trajectories (issue 50, item 8)."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli, save_image, write_clip

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
SIZES = [(320, 240), (640, 360), (200, 450), (512, 384), (150, 150), (400, 100)]


@pytest.mark.parametrize("family, factor", [("qwen2_5_vl", 28), ("qwen3_vl", 32), ("qwen2_vl", 28)])
def test_vllm_answers_equal_the_hf_backend(tmp_path, family, factor):
    pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    from transformers import AutoProcessor

    model = build_tiny_model(tmp_path / "model", family, size="small")
    policy = ResizePolicy.from_processor(AutoProcessor.from_pretrained(model).image_processor)
    assert policy.factor == factor
    # the folder's record and its processor agree, as an export's do
    write_policy_record(model, policy, VideoPolicy(2048, 8192, factor, 2.0, 8, FAMILIES[family].video_clock))
    images = [str(save_image(tmp_path / f"i{k}.jpg", w, h)) for k, (w, h) in enumerate(SIZES)]
    # clips (mp4, and webm at a size the frame rounds) mixed with the images, in the same batches
    clips = [str(write_clip(tmp_path / "a.mp4", 3, 10, 160, 90)),
             str(write_clip(tmp_path / "b.webm", 5, 10, 150, 100, codec="libvpx"))]
    rows = {}
    for backend in ("hf", "vllm"):
        out = tmp_path / f"{backend}.jsonl"
        result = run_cli(["qwenvl-prep", "predict", str(model), *images, *clips, "--prompt", "Where is the cat? "
                          "Answer in JSON.", "--max-new-tokens", "24", "--batch-size", "3", "--backend", backend,
                          "-o", str(out)], None, tmp_path, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[backend] = [json.loads(line) for line in out.read_text().splitlines()]
        assert json.loads(out.with_name(out.name + ".settings.json").read_text())["settings"]["backend"] == backend
    same = [a["predict"] == b["predict"] for a, b in zip(rows["hf"], rows["vllm"])]
    # float32 on both sides; a greedy tie broken the other way by another reduction order may change one answer
    assert sum(same) >= len(same) - 1, [(a["predict"], b["predict"]) for a, b in zip(rows["hf"], rows["vllm"])]
    assert len(same) == len(SIZES) + len(clips) and [row.get("video") for row in rows["vllm"][len(SIZES):]] == clips
    for a, b in zip(rows["hf"], rows["vllm"]):
        assert a["model_size"] == b["model_size"] and a["orig_size"] == b["orig_size"]
        assert a.get("frames") == b.get("frames") and a.get("duration") == b.get("duration")
        if a["predict"] == b["predict"]:
            assert a["items"] == b["items"]


def test_an_adapter_folder_is_refused_with_the_merge_command(tiny_model, tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model),
                                                             "peft_type": "LORA"}))
    image = save_image(tmp_path / "i.jpg", 320, 240)
    result = run_cli(["qwenvl-prep", "predict", str(adapter), str(image), "--prompt", "p", "--backend", "vllm"],
                     None, tmp_path)
    assert result.returncode == 2 and "llamafactory-cli export" in result.stderr and "--backend hf" in result.stderr


def test_agent_eval_on_vllm_plays_the_hf_backends_trajectories(tmp_path):
    """Greedy multi-turn play against the simulator (screens that change size every turn, up to three screenshots
    in one prompt): vLLM's answers are the HF backend's, turn for turn, and each turn is shown in the same frame."""
    pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", "qwen2_5_vl", size="small")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)  # small screens (a few dozen tokens each), as an export writes
    processor.image_processor.size = {"shortest_edge": 16 * 28 * 28, "longest_edge": 64 * 28 * 28}
    for key, value in (("min_pixels", 16 * 28 * 28), ("max_pixels", 64 * 28 * 28)):
        if hasattr(processor.image_processor, key):
            setattr(processor.image_processor, key, value)
    processor.save_pretrained(model)
    write_policy_record(model, ResizePolicy.from_processor(AutoProcessor.from_pretrained(model).image_processor))
    env_kwargs = json.dumps({"reader": "raw", "letter": "a", "screens": 3, "change_size": True})
    rows = {}
    for backend in ("hf", "vllm"):
        out = tmp_path / f"{backend}.jsonl"
        result = run_cli(["qwenvl-prep", "agent-eval", str(model), "--env", "qwenvl_prep.demos.gui_env:ClickThroughEnv",
                          "--env-kwargs", env_kwargs, "--tasks", "4", "--max-turns", "3", "--max-new-tokens", "12",
                          "--batch-size", "4", "--isolation", "inline", "--backend", backend, "-o", str(out)], None,
                         tmp_path, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[backend] = [json.loads(line) for line in out.read_text().splitlines()]
    turns = {backend: [turn for row in rows[backend] for turn in row["turns"]] for backend in rows}
    same = [a["answer"] == b["answer"] for a, b in zip(turns["hf"], turns["vllm"])]
    # float32 on both sides; a greedy tie broken the other way changes that answer and what follows it
    assert sum(same) >= len(same) - 3 and len(turns["hf"]) >= 8, [(a["answer"], b["answer"]) for a, b in
                                                                     zip(turns["hf"], turns["vllm"])]
    assert max(len(row["turns"]) for row in rows["vllm"]) >= 2  # later turns held several screenshots
    for a, b in zip(turns["hf"], turns["vllm"]):
        assert a["orig_size"] == b["orig_size"] and a["model_size"] == b["model_size"]
