"""The worked example (docs/worked-example.md, "Your own COCO dataset, start to finish") run block by block, so it
cannot drift from the code: every fenced block between its worked-example markers, in order. A block whose first line is
``# NAME.yaml`` or ``# NAME.py`` is written to that file; a bash block is run; the one that starts
``llamafactory-cli api`` runs in the background until the end. What the test changes is listed here and nothing
else: the model (a tiny random-weight Qwen2.5-VL instead of the hub id), the port (a free one), and in the training
YAMLs the keys that size a run for a GPU (``RUN_ON_CPU``, ``SMALLER``; bf16 and num_train_epochs dropped). The
data is a small synthetic COCO set in COCO's layout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers import BIN
from PIL import Image, ImageDraw

README = Path(__file__).resolve().parents[2] / "docs" / "worked-example.md"
START, END = "<!-- worked-example: start -->", "<!-- worked-example: end -->"
HUB_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
PORT = "8000"
RUN_ON_CPU = {"use_cpu": True, "max_steps": 2}  # set in every training YAML; bf16 and num_train_epochs are dropped
SMALLER = {"grpo_num_generations": 2, "max_new_tokens": 16}  # replaced where the YAML sets them
CATEGORIES = [{"id": 3, "name": "car"}, {"id": 17, "name": "cat"}, {"id": 18, "name": "dog"}]
COLOURS = {3: (200, 40, 40), 17: (40, 200, 40), 18: (40, 40, 200)}


def example_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the worked example, in order."""
    text = README.read_text()
    assert text.count(START) == 1 and text.count(END) == 1, "the worked example's markers moved"
    section = text[text.index(START):text.index(END)]
    return re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)


def write_split(root: Path, split: str, images: list[tuple[int, int, int, list]]) -> None:
    """COCO's layout: root/annotations/instances_SPLIT.json and root/SPLIT/*.jpg, with the boxes drawn in."""
    records, annotations = [], []
    for image_id, width, height, boxes in images:
        name = f"{image_id:012d}.jpg"
        picture = Image.new("RGB", (width, height), (128, 128, 128))
        draw = ImageDraw.Draw(picture)
        for category, (x, y, w, h), crowd in boxes:
            draw.rectangle([x, y, x + w, y + h], fill=COLOURS[category])
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": category,
                                "bbox": [x, y, w, h], "area": w * h, "iscrowd": crowd})
        (root / split).mkdir(parents=True, exist_ok=True)
        picture.save(root / split / name, quality=90)
        records.append({"id": image_id, "file_name": name, "width": width, "height": height})
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(
        {"images": records, "annotations": annotations, "categories": CATEGORIES}))


def synthetic_coco(root: Path) -> None:
    """Phone-like, portrait, screenshot-like and small images; a crowd region; an image without annotations."""
    write_split(root, "train", [
        (1, 640, 480, [(18, (40, 60, 200, 150), 0), (3, (400, 300, 180, 120), 0)]),
        (2, 480, 640, [(17, (100, 100, 160, 240), 0)]),
        (3, 800, 450, [(18, (500, 50, 200, 300), 0), (18, (50, 50, 150, 150), 0)]),
        (4, 320, 240, [(3, (20, 20, 120, 80), 0), (3, (160, 120, 140, 100), 1)]),
        (5, 640, 480, []),
        (6, 640, 480, [(17, (300, 200, 250, 200), 0)]),
        (7, 480, 640, [(18, (60, 300, 300, 250), 0)]),
        (8, 800, 450, [(3, (100, 200, 300, 200), 0)]),
    ])
    write_split(root, "val", [
        (101, 640, 480, [(18, (200, 100, 240, 200), 0)]),
        (102, 480, 640, [(17, (80, 160, 250, 300), 0)]),
        (103, 800, 450, [(3, (300, 100, 350, 250), 0)]),
    ])


def for_this_machine(name: str, text: str, model: Path, port: str) -> str:
    """A block's text with the substitutions the module docstring lists."""
    text = re.sub(rf"\b{PORT}\b", port, text.replace(HUB_MODEL, str(model)))
    if not name.endswith(".yaml"):
        return text
    config = yaml.safe_load(text)
    if "stage" in config:
        config = {key: value for key, value in config.items() if key not in ("bf16", "num_train_epochs")}
        config.update(RUN_ON_CPU, **{key: value for key, value in SMALLER.items() if key in config})
    return yaml.safe_dump(config, sort_keys=False)


def free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def wait_for(server: subprocess.Popen, port: str, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the API server exited {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the API server did not come up:\n{log.read_text()[-4000:]}")


@pytest.mark.slow
def test_the_readme_worked_example_runs_as_written(tiny_model, tmp_path):
    work = tmp_path / "project"
    synthetic_coco(work / "my_coco")
    port = free_port()
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
           "DISABLE_VERSION_CHECK": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    outputs, server = [], None
    try:
        for language, text in example_blocks():
            first = text.splitlines()[0] if text.strip() else ""
            if language in ("yaml", "python") and re.fullmatch(r"# [\w.-]+\.(yaml|py)", first):
                name = first[2:]
                (work / name).write_text(for_this_machine(name, text, tiny_model, port))
            elif language == "bash":
                command = for_this_machine("", text, tiny_model, port)
                if "llamafactory-cli api" in command:
                    log = work / "server.log"
                    with open(log, "w") as out:  # the child keeps its own descriptor
                        server = subprocess.Popen(["bash", "-c", command], cwd=work, env=env, start_new_session=True,
                                                  stdout=out, stderr=subprocess.STDOUT)
                    wait_for(server, port, log)
                    continue
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=work, env=env,
                                      capture_output=True, text=True, timeout=600, check=False)
                assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
                outputs.append(done.stdout)
            else:
                assert language in ("", "text"), f"a {language} block the test does not know what to do with"
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    assert server is not None, "the example no longer serves"

    info = json.loads((work / "data" / "dataset_info.json").read_text())
    assert {"coco_train", "coco_val"} <= set(info) and info["coco_train"]["qwenvl_policy"]["max_pixels"] == 1003520
    train = json.loads((work / "data" / "coco_train.json").read_text())
    assert any(r["messages"][1]["content"] == "[]" for r in train), "no 'not present' sample"
    assert list((work / "drawn").glob("*.jpg"))
    grpo_log = [json.loads(line) for line in (work / "saves" / "coco-grpo" / "trainer_log.jsonl").read_text()
                .splitlines()]
    assert any("rewards/count_reward/mean" in row for row in grpo_log), "the custom reward did not run"
    assert json.loads((work / "saves" / "coco-exported" / "qwenvl_policy.json").read_text())["max_pixels"] == 1003520
    val = json.loads((work / "data" / "coco_val.json").read_text())
    assert len((work / "preds.jsonl").read_text().splitlines()) == len(val)
    assert "Acc@0.5" in outputs[-2] and "not present (answer [])" in outputs[-2]  # eval's table
    assert outputs[-1].strip(), "the openai client got no answer"
