from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:  # one thread per worker: the workers share the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from qwenvl_prep.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2_5_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_model_qwen3(tmp_path_factory) -> Path:
    from qwenvl_prep.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3_vl", "qwen3_vl")


@pytest.fixture(scope="session")
def tiny_model_qwen2(tmp_path_factory) -> Path:
    from qwenvl_prep.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2_vl", "qwen2_vl")
