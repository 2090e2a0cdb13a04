"""Peak memory and time of the GRPO weight sync to vLLM (what one rank holds while it hands the model to its engine),
against model size, for the current code and, with ``--previous REV``, for that revision (a git worktree), in one
run::

    .venv/bin/python benchmarks/bench_weight_sync.py --previous 97f659e [--layers 4 8 16] [--hidden 1024]

Each case is ``torchrun`` with 2 ranks (gloo) over a random-weight Qwen2.5-VL of ``--hidden`` and N text layers,
LoRA r=64 on every linear layer of the language model, under DeepSpeed ZeRO-3 (``--no-zero3``: plain, every rank
holding the model). A sync is what ``VLLMEngine.load_weights`` does before it calls vLLM, with vLLM's side replaced
by what its layerwise reload keeps alive (the tensors of the layer being loaded; the real reload is tested in
tests/unit/grpo/test_vllm_rollout.py):

- a revision whose ``engine_weights(model)`` returns a dict (before issue 32): every parameter gathered at once,
  then a dict of every weight with each adapted one as a base + delta copy, handed over whole;
- the current ``engine_weights(model, zero3)``: block after block, each gathered on its own.

Peak = the highest resident set size a sampler thread saw during the sync (every 0.2 ms), less the size before it,
per rank (the larger rank's is reported), with glibc's mmap threshold fixed at 128 KiB so that a freed tensor leaves
the resident set at once; time = the sync's wall time. Three syncs per case, the last two reported (the first warms
caches).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class PeakRss:
    """The highest resident set size seen while the block runs, in bytes above the size at entry."""

    def __enter__(self) -> "PeakRss":
        self.start = self._rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def added(self) -> int:
        return self.peak - self.start

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def _watch(self) -> None:
        while not self._stop.wait(0.0002):
            self.peak = max(self.peak, self._rss())


def build_model(hidden: int, layers: int):
    """A random-weight Qwen2.5-VL with LoRA on the language model's linear layers, in bfloat16."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 512, 1), vocab_size=32000,
                max_position_embeddings=4096, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
    vision = dict(depth=4, hidden_size=512, intermediate_size=1376, num_heads=8, out_hidden_size=hidden,
                  fullatt_block_indexes=[3])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=64, lora_alpha=128, target_modules=LORA_TARGETS,
                                            exclude_modules=r".*visual.*", init_lora_weights=False))


def reload_like_vllm(items, block_of) -> None:
    """What vLLM's layerwise reload keeps alive while it loads: the tensors of the layer (block) being loaded."""
    held, block = [], None
    for name, tensor in items:
        if block_of(name) != block:
            held, block = [], block_of(name)
        held.append(tensor)


def sync(model, zero3: bool) -> None:
    """One sync as the installed ``weight_sync`` does it."""
    import torch

    from llamafactory_qwenvl_patch.grpo.generation import weight_sync

    with torch.no_grad():
        if "zero3" in inspect.signature(weight_sync.engine_weights).parameters:
            reload_like_vllm(weight_sync.engine_weights(model, zero3), weight_sync.block_of)
            return
        from contextlib import nullcontext

        gather = nullcontext
        if zero3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters
        with gather(list(model.parameters())):  # the previous load_weights: one list of every weight for vLLM
            handed = list(weight_sync.engine_weights(model).items())
            del handed


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build_model(args.hidden, args.layers[0])
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.zero3:
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True}
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        model = engine.module
    rows = []
    for _ in range(3):
        gc.collect()
        dist.barrier()
        with PeakRss() as peak:
            start = time.perf_counter()
            sync(model, args.zero3)
            seconds = time.perf_counter() - start
        rows.append((peak.added, seconds))
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, rows[1:])
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"model_mb": size / 2**20,
                                      "peak_mb": max(a for rank in found for a, _ in rank) / 2**20,
                                      "seconds": sum(s for _, s in found[0]) / len(found[0])}))
    dist.destroy_process_group()


def run_case(code_root: Path, hidden: int, layers: int, zero3: bool) -> dict:
    # every allocation above 128 KiB its own mapping, returned on free: glibc's default raises that threshold after
    # the first large free and then keeps freed tensors resident, so RSS would add up past syncs instead of peaking
    env = {**os.environ, "PYTHONPATH": str(code_root), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), "--worker", "--hidden", str(hidden), "--layers", str(layers)]
    if not zero3:
        command.append("--no-zero3")
    out = subprocess.run(command, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    found = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not found:
        raise RuntimeError(f"case {layers} layers ({code_root}) failed:\n{out.stderr[-3000:]}")
    return json.loads(found[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--no-zero3", dest="zero3", action="store_false")
    parser.add_argument("--previous", metavar="REV", help="also measure this revision's sync (a git worktree)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    roots = {"current": ROOT}
    with tempfile.TemporaryDirectory() as scratch:
        if args.previous:
            tree = Path(scratch) / "previous"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.previous],
                           check=True, capture_output=True)
            roots["previous"] = tree
        try:
            results = []
            for layers in args.layers:
                for name, root in roots.items():
                    row = {"code": name, "layers": layers, **run_case(root, args.hidden, layers, args.zero3)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            if args.previous:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(roots["previous"])],
                               check=False, capture_output=True)
    print(f"\n| model (bf16) | code | sync peak per rank | sync time |  ({'ZeRO-3' if args.zero3 else 'no ZeRO'}, "
          "2 ranks)\n|---|---|---|---|")
    for row in results:
        print(f"| {row['model_mb']:.0f} MB ({row['layers']} layers) | {row['code']} | {row['peak_mb']:.0f} MB | "
              f"{row['seconds']:.2f} s |")


if __name__ == "__main__":
    main()
