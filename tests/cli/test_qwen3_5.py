"""Qwen3.5 and Qwen3.5-MoE end to end: the checkpoint alone decides the frame (no template hint), and the MoE goes
through convert -> SFT (LoRA, batch 2 of mixed sizes, accumulation 2) -> GRPO from the SFT adapter (shared prefix
on) -> export -> fix-config -> predict -> eval with ``llamafactory-cli`` and ``qwenvl-prep``. The dense model's
chain is the demo's smoke run (``tests/cli/test_demo.py``)."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import read_log, run_cli, save_image, train_config

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.model_files.experts import cpu_grouped_mm_runs

SIZES = [(640, 480), (1920, 1080), (333, 777), (1024, 768)]
MIN_PIXELS, MAX_PIXELS = 64 * 32 * 32, 256 * 32 * 32


def raw_dataset(folder, sizes=SIZES):
    """{image, question, answer} JSONL in original pixels: one box per photo, a third of the way in."""
    rows = []
    for i, (w, h) in enumerate(sizes):
        save_image(folder / f"p{i}.jpg", w, h)
        box = [w // 3, h // 3, 2 * w // 3, 2 * h // 3]
        rows.append({"image": f"p{i}.jpg", "question": "Locate the box and output its bbox_2d in JSON.",
                     "answer": json.dumps([{"bbox_2d": box, "label": "box"}])})
    path = folder / "raw.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path, rows


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_convert_without_a_template_takes_the_checkpoints_frame(tmp_path, tiny_model_qwen3_5, tiny_model_qwen3_5_moe,
                                                                 moe, capsys):
    """A YAML without ``template:``: the frame is Qwen3.5's (factor 32, relative 0-1000), not Qwen2.5-VL's."""
    from qwenvl_prep.cli import main

    model = tiny_model_qwen3_5_moe if moe else tiny_model_qwen3_5
    raw, rows = raw_dataset(tmp_path)
    spec = tmp_path / "sft.yaml"
    spec.write_text(yaml.safe_dump({"model_name_or_path": str(model), "qwenvl_patch": True, "stage": "sft",
                                    "image_min_pixels": MIN_PIXELS, "image_max_pixels": MAX_PIXELS}))
    out = tmp_path / "data" / "train.json"
    assert main(["convert", str(raw), "-o", str(out), "--from-yaml", str(spec), "--input-coords", "abs", "-q"]) == 0
    stamp = json.loads(capsys.readouterr().out)["stamp"]
    assert (stamp["family"], stamp["factor"], stamp["coords"]) == ("qwen3_5", 32, "rel1000")
    policy = ResizePolicy(MIN_PIXELS, MAX_PIXELS, 32)
    for record, row, (w, h) in zip(json.loads(out.read_text()), rows, SIZES):
        box = json.loads(record["messages"][1]["content"])[0]["bbox_2d"]
        original = json.loads(row["answer"])[0]["bbox_2d"]
        assert box == convert_coords(original, "orig", "rel1000", (h, w), policy.model_size(h, w))
        assert box == [round(v * 1000 / s) for v, s in zip(original, (w, h, w, h))]


@pytest.mark.slow
def test_moe_convert_sft_grpo_export_predict_eval(tmp_path, tiny_model_qwen3_5_moe):
    model = tiny_model_qwen3_5_moe
    raw, _ = raw_dataset(tmp_path / "raw")
    data = tmp_path / "data"
    common = dict(template="qwen3_5_nothink", image_min_pixels=MIN_PIXELS, image_max_pixels=MAX_PIXELS,
                  dataset="train")
    sft_config = train_config(model, data, tmp_path / "sft", per_device_train_batch_size=2,
                              gradient_accumulation_steps=2, max_steps=2, learning_rate=5e-3, **common)
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(sft_config))
    for name in ("train", "eval"):
        result = run_cli(["qwenvl-prep", "convert", str(raw), "-o", str(data / f"{name}.json"), "--from-yaml",
                          str(tmp_path / "sft.yaml"), "--input-coords", "abs", "-q"], None, tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(["llamafactory-cli", "train"], sft_config, tmp_path / "sft-run")
    assert result.returncode == 0, result.stderr[-4000:]
    assert ("experts_implementation=eager" in result.stdout + result.stderr) == (not cpu_grouped_mm_runs())

    grpo_config = train_config(model, data, tmp_path / "grpo", stage="grpo", adapter_name_or_path=str(
        tmp_path / "sft"), per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=2, save_steps=2,
        grpo_num_generations=4, max_new_tokens=12, temperature=1.0, reward_funcs="iou,format", **common)
    result = run_cli(["llamafactory-cli", "train"], grpo_config, tmp_path / "grpo-run")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "grpo_shared_prefix: on" in output
    assert len([row for row in read_log(tmp_path / "grpo") if "loss" in row]) == 2

    export = tmp_path / "exported"
    result = run_cli(["llamafactory-cli", "export"], {
        "model_name_or_path": str(model), "adapter_name_or_path": str(tmp_path / "grpo"), "finetuning_type": "lora",
        "qwenvl_patch": True, "export_dir": str(export), "export_size": 1, "export_device": "cpu", **{
            k: v for k, v in common.items() if k != "dataset"}}, tmp_path / "export-run")
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads((export / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    assert json.loads((export / "qwenvl_policy.json").read_text())["factor"] == 32
    result = run_cli(["qwenvl-prep", "fix-config", str(export), "--yaml", str(tmp_path / "sft.yaml")], None, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["problems"] == [] and any("exists only from transformers 5.2" in line
                                            for line in report["readers"]["transformers-4.57"])

    predictions = tmp_path / "predictions.jsonl"
    result = run_cli(["qwenvl-prep", "predict", str(export), "--dataset", str(data / "eval.json"), "-o",
                      str(predictions), "--max-new-tokens", "16"], None, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(rows) == len(SIZES)
    assert all(row["coords"] == "rel1000" and row["model_size"][0] % 32 == 0 for row in rows)
    result = run_cli(["qwenvl-prep", "eval", str(data / "eval.json"), "--predictions", str(predictions),
                      "--json-out", str(tmp_path / "eval.json")], None, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["overall"]["samples"] == len(SIZES)


@pytest.mark.slow
def test_lf_api_serves_a_qwen3_5_checkpoint_in_its_frame(tmp_path, tiny_model_qwen3_5):
    """``llamafactory-cli api`` (HF engine, the ``openai`` client) on a pinned Qwen3.5 folder, no key in the
    serving YAML: the image tokens it reports for three sizes (below min_pixels, above max_pixels, an odd aspect)
    are the policy's, and it answers."""
    from test_serving import Server, data_url

    data = tmp_path / "data"
    raw, _ = raw_dataset(tmp_path / "raw")
    spec = train_config(tiny_model_qwen3_5, data, tmp_path / "pinned", finetuning_type="full",
                        template="qwen3_5_nothink", image_min_pixels=MIN_PIXELS, image_max_pixels=MAX_PIXELS,
                        dataset="train", max_steps=2, save_steps=1000)
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(spec))
    result = run_cli(["qwenvl-prep", "convert", str(raw), "-o", str(data / "train.json"), "--from-yaml",
                      str(tmp_path / "sft.yaml"), "--input-coords", "abs", "-q"], None, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(["llamafactory-cli", "train"], spec, tmp_path / "sft-run")
    assert result.returncode == 0, result.stderr[-4000:]
    media = tmp_path / "media"
    media.mkdir()
    server = Server(tmp_path / "api", {"model_name_or_path": str(tmp_path / "pinned"), "template": "qwen3_5_nothink",
                                       "infer_backend": "huggingface"}, media)
    try:
        sizes = [(100, 80), (4032, 3024), (333, 777)]
        replies = [server.ask(data_url(w, h)) for w, h in sizes]
    finally:
        server.stop()
    policy = ResizePolicy(MIN_PIXELS, MAX_PIXELS, 32)
    tokens = [reply.usage.prompt_tokens for reply in replies]
    expected = [policy.image_tokens(h, w) for w, h in sizes]
    assert len(set(expected)) == 3
    assert [t - tokens[0] for t in tokens] == [e - expected[0] for e in expected]
    assert all(reply.choices[0].message.content is not None for reply in replies)
