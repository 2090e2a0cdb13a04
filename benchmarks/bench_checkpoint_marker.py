"""What checkpoint integrity costs: the complete-marker with a sha256 per file (written at every save) and its
verification (before a resume), against writing the checkpoint itself, in one run::

    .venv/bin/python benchmarks/bench_checkpoint_marker.py [--mb 300]

The checkpoint is a LoRA GRPO checkpoint's shape: an adapter (1/3 of ``--mb``) in safetensors and an optimizer
state (2/3) saved by ``torch.save``, plus the small JSON files. Reported: the seconds to write those files (the
baseline: what a save costs without the marker), to write the marker, to verify it, and the marker's share of a
save. Files are read back from the page cache, as they are right after a save.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from llamafactory_qwenvl_patch.grpo.trainer.resume import mark_complete, verify


def write_checkpoint(folder: Path, mb: int) -> float:
    start = time.perf_counter()
    floats = mb * 2**20 // 4
    generator = torch.Generator().manual_seed(0)
    save_file({"base_model.lora_A.weight": torch.randn(floats // 3, generator=generator)},
              str(folder / "adapter_model.safetensors"))
    torch.save({"state": torch.randn(floats - floats // 3, generator=generator)}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=300, help="checkpoint size in MiB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "checkpoint-10"
        folder.mkdir()
        save = write_checkpoint(folder, args.mb)
        start = time.perf_counter()
        mark_complete(folder, 10)
        mark = time.perf_counter() - start
        start = time.perf_counter()
        verify(folder)
        check = time.perf_counter() - start
    result = {"checkpoint_mb": args.mb, "save_s": round(save, 3), "marker_s": round(mark, 3),
              "verify_s": round(check, 3), "marker_share_of_save": round(mark / (save + mark), 3),
              "hash_mb_per_s": round(args.mb / check, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
