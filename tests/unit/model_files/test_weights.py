"""Weight files cut short are found from their headers, before a loader starts (issue 51's review: a truncated
model.safetensors stopped predict with a safetensors traceback, and vLLM only once its engine had started)."""

from __future__ import annotations

import json
import shutil

import pytest

from llamafactory_qwenvl_patch.model_files.weights import weights_problems


def test_whole_cut_and_missing_weights_are_told_apart(tiny_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    assert weights_problems(folder) == []
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    for size, message in ((len(data) - 1, "its tensors end at byte"), (100, "bytes of metadata"),
                          (5, "shorter than a safetensors header")):
        weights.write_bytes(data[:size])
        [problem] = weights_problems(folder)
        assert problem.startswith(f"{weights}: ") and message in problem, problem
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + data[24:])
    assert "its header is not JSON" in weights_problems(folder)[0]
    weights.write_bytes(data)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert weights_problems(folder) == [f"{folder / 'model.safetensors.index.json'}: names the shard "
                                        f"model-00002-of-00002.safetensors, which is not in {folder}"]


def test_predict_names_a_damaged_folder_before_loading(tiny_model, tmp_path):
    """Every backend's folder (and agent-eval's) goes through FolderModel: weights cut short and a folder without
    tokenizer files (transformers asked for sentencepiece, which a Qwen tokenizer does not use) are named."""
    from qwenvl_prep.pipeline.predict import FolderModel

    cut, bare = tmp_path / "cut", tmp_path / "bare"
    shutil.copytree(tiny_model, cut)
    shutil.copytree(tiny_model, bare)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):  # transformers 4.57 writes the last two as well
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="cut cannot be loaded: .*model.safetensors: is .* it is cut short"):
        FolderModel(cut)
    with pytest.raises(ValueError, match="bare: has no tokenizer files \\(tokenizer.json, or vocab.json"):
        FolderModel(bare)
