"""A pinned export (``llamafactory-cli export`` under ``qwenvl_patch: true``) read by transformers 4.49 and 4.57 (real
side environments) and 5.x (installed) as training saw it: config, tokenizer, processor, chat template, the policy's
grid for every image size, the video frame and the logits (vLLM's readings: tests/serving/test_vllm_serve.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fix_config, run_cli

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy

MIN, MAX = 16 * 28 * 28, 64 * 28 * 28
SIZES = [(60, 40), (1920, 1080), (333, 777), (1000, 100)]  # below min_pixels, above max_pixels, odd aspects
TEXTS = ["Locate the red square: [12, 34]", "Cafe\u0301 \ufb01 \uff21 <|image_pad|> 12  x\n\n y", "日本語 1,234.50 EUR"]


READER = r"""
import json, sys
import numpy as np
from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer, GenerationConfig


def read(folder, texts, sizes):
    config = AutoConfig.from_pretrained(folder)
    GenerationConfig.from_model_config(config)
    text = config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or {**text.rope_scaling, "rope_theta": text.rope_theta}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder, use_fast=False)  # 4.x: the one needing min/max
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where is it?"}]}]
    return {
        "architectures": config.architectures, "rope_theta": rope["rope_theta"],
        "mrope_section": rope["mrope_section"], "tie_word_embeddings": config.tie_word_embeddings,
        "ids": [tokenizer.encode(t) for t in texts], "processor_ids": [processor.tokenizer.encode(t) for t in texts],
        "chat": processor.apply_chat_template(messages, add_generation_prompt=True),
        "grids": [image_processor(images=[np.zeros((h, w, 3), dtype=np.uint8)], return_tensors="np")
                  ["image_grid_thw"][0].tolist() for w, h in sizes],
    }


texts, sizes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps([read(folder, texts, sizes) for folder in sys.argv[3:]]))
"""


def read_with(python: str | Path, *folders: Path) -> list[dict]:
    """What a transformers (the one of ``python``) reads from each folder: config, tokenizer, processor, chat
    template, and the slow image processor's grid for every size in SIZES."""
    result = subprocess.run([str(python), "-c", READER, json.dumps(TEXTS), json.dumps(SIZES), *map(str, folders)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def export(source: Path, workdir: Path, template: str, bin_dir: Path | None = None) -> Path:
    """``llamafactory-cli export`` of a pinned run (what a user runs after training)."""
    out = workdir / "export"
    config = {"model_name_or_path": str(source), "template": template, "qwenvl_patch": True,
              "image_min_pixels": MIN, "image_max_pixels": MAX, "export_dir": str(out), "infer_dtype": "float32"}
    result = run_cli(["llamafactory-cli", "export"], config, workdir, bin_dir=bin_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "written in the portable layout" in result.stdout + result.stderr
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # the folder LF wrote into is gone
    return out


def policy_grids(factor: int) -> list[list[int]]:
    policy = ResizePolicy(MIN, MAX, factor)
    return [[1, *(side // (factor // 2) for side in policy.model_size(h, w))] for w, h in SIZES]


@pytest.mark.slow
def test_pinned_export_reads_the_same_in_transformers_4_49_4_57_and_5(tiny_model, old_transformers, transformers_457,
                                                                      tmp_path, capsys):
    """The export of the main tested set (transformers 5.x) needs no repair: transformers 4.49, 4.57 (the second
    tested set's environment, ``.venv-tf457``) and 5.x all load config, tokenizer, processor and chat template from
    it, tokenize exactly as training did (non-NFC text and special tokens included), and resize every image size to
    the policy's grid. (Qwen3-VL, which has no transformers before 4.57: the 4.57 test below.)"""
    pytest.importorskip("transformers", minversion="5.0", reason="the main tested set writes the export")
    folder = export(tiny_model, tmp_path, "qwen2_vl")
    code, report, _ = fix_config(capsys, folder)
    assert code == 0 and not any(report["readers"].values())
    truth, new = read_with(sys.executable, tiny_model, folder)
    assert truth["grids"] != policy_grids(28)  # the source's own bounds are not the run's
    truth["grids"] = policy_grids(28)
    assert new == truth
    assert read_with(old_transformers, folder) == read_with(transformers_457, folder) == [truth]
    import numpy as np
    import torch
    from transformers import AutoModelForImageTextToText, AutoVideoProcessor

    from llamafactory_qwenvl_patch.frame.policy_record import folder_video_policy

    # the video frame too (issue 40): a reader without the plugin resizes each frame to the recorded video policy's
    video, frames = folder_video_policy(folder), np.zeros((4, 480, 640, 3), np.uint8)
    grids = {name: AutoVideoProcessor.from_pretrained(source)(videos=[frames], return_tensors="pt")["video_grid_thw"]
             for name, source in (("export", folder), ("source", tiny_model))}
    want = [2, *(side // 14 for side in video.frame_size(480, 640))]
    assert grids["export"].tolist() == [want] and grids["source"].tolist() != [want], grids

    ids = torch.tensor([truth["ids"][0]])
    before = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32)
    after = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    assert torch.equal(before(input_ids=ids).logits, after(input_ids=ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize("family, template", [("qwen3_vl", "qwen3_vl_nothink")])
def test_pinned_export_reads_the_same_in_transformers_4_57(tmp_path, transformers_457, capsys, family, template):
    """transformers 4.57.6, the last 4.x (the second tested set's environment, ``.venv-tf457``), loads the pinned
    export of Qwen3-VL as 5.x does: config (rope, weight tying, architectures), tokenizer, processor, chat template,
    and the policy's grid for every image size (Qwen2.5-VL's: the test above). (The vLLM set that read exports with
    4.57 is retired.)"""
    pytest.importorskip("transformers", minversion="5.0", reason="the main tested set writes the export")
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    source = build_tiny_model(tmp_path / "base", family)
    folder = export(source, tmp_path, template)
    capsys.readouterr()  # what building the model printed
    code, report, _ = fix_config(capsys, folder)
    assert code == 0 and report["readers"]["transformers-4.57"] == []
    truth, new = read_with(sys.executable, source, folder)
    truth["grids"] = policy_grids(FAMILIES[family].factor)
    assert new == truth
    assert read_with(transformers_457, folder) == [truth]
