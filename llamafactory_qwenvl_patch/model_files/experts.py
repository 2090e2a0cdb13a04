"""How a mixture-of-experts checkpoint (Qwen3.5-MoE, Qwen3-VL-MoE) can run its experts on this machine.

transformers 5.x runs experts with ``grouped_mm`` by default and falls back to a loop only where it knows the kernel
is missing (old GPUs, misaligned CPU tensors). torch before 2.10 has the operator but no CPU kernel, so on a CPU
every forward with aligned weights (any model after an optimiser step) fails with ``Could not run
'aten::_grouped_mm' with arguments from the 'CPU' backend``. There the experts are loaded ``eager`` instead: the
same math, one matmul per expert.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

EAGER = "eager"


@lru_cache(maxsize=1)
def cpu_grouped_mm_runs() -> bool:
    """Whether this torch runs ``grouped_mm`` on CPU tensors (tried once on a 2-expert toy product)."""
    import torch

    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:  # transformers uses its own loop then
        return True
    try:
        grouped_mm(torch.ones(2, 16), torch.ones(2, 16, 16), offs=torch.tensor([1, 2], dtype=torch.int32))
    except (NotImplementedError, RuntimeError):
        return False
    return True


def has_experts(config: dict[str, Any]) -> bool:
    """A ``config.json`` (as a dict) of a mixture-of-experts model: its text config counts experts."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return bool(text.get("num_experts"))


def experts_load_kwargs(config: dict[str, Any], on_cpu: bool) -> dict[str, str]:
    """``from_pretrained`` keywords that let a checkpoint with this ``config.json`` run here: ``experts_implementation:
    eager`` for a MoE model on a CPU whose torch has no grouped_mm kernel, else none."""
    if not on_cpu or not has_experts(config) or cpu_grouped_mm_runs():
        return {}
    return {"experts_implementation": EAGER}


def folder_experts_load_kwargs(model_dir: str | os.PathLike) -> dict[str, str]:
    """``experts_load_kwargs`` for a local checkpoint loaded on the CPU (none for a folder without a config)."""
    path = Path(model_dir, "config.json")
    return experts_load_kwargs(json.loads(path.read_text()), on_cpu=True) if path.is_file() else {}
