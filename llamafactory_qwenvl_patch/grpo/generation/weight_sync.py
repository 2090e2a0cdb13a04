"""The weight sync of the vLLM rollout engine: the training weights under vLLM's checkpoint names, block by block
(LoRA deltas added out of place, ZeRO-3 blocks gathered one at a time), pushed through vLLM's in-place reload. Apart
from ``vllm_engine`` (generation): what moves the weights and what samples with them are read apart.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
NO_CHECKPOINT_LAYERS = {"RotaryEmbedding", "MRotaryEmbedding", "FusedInputNorm"}  # vLLM classes, buffers only


def vllm_version() -> str:
    from vllm import __version__

    return __version__


def vllm_weight_name(name: str, peft_prefix: str = "lora_") -> str | None:
    """The checkpoint name vLLM's ``load_weights`` takes for a (peft-wrapped) training parameter; None for adapter
    weights (merged into the base weights before the sync) and peft's saved copies of original modules."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if peft_prefix in name or "original_module" in name:
        return None
    return name.replace("modules_to_save.default.", "")


def block_of(name: str) -> str:
    """The block a checkpoint name sits in: the path up to its first index (``model.language_model.layers.3``,
    ``model.visual.blocks.0``), else its module. vLLM fuses weights only within a block (q/k/v into ``qkv_proj``,
    gate/up, the experts), so a sync that sends block after block never splits a vLLM layer."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


def _lora_modules(model: Any, prefix: str) -> dict[str, Any]:
    """Checkpoint name of each adapted base weight -> its unmerged peft LoRA layer."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            target = vllm_weight_name(f"{module_name}.base_layer.weight", prefix)
            if target is not None:
                found[target] = module
    return found


def engine_weights(model: Any, zero3: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of the model as it samples, block by block: a peft model's active LoRA deltas added
    to the base weights they adapt, out of place (merging into the base and unmerging after, as trl does, leaves
    rounding noise in the frozen base weights at every sync). ``zero3``: each block's parameters are gathered on
    their own and copied out, so a sync holds one block beyond the shards (a copy stays valid until vLLM has loaded
    its layer). Run it under ``torch.no_grad``; the model is not modified."""
    peft = hasattr(model, "peft_config")
    prefix = getattr(model, "prefix", "lora_")
    named = [(vllm_weight_name(name, prefix) if peft else name, param) for name, param in model.named_parameters()]
    named = [(target, param) for target, param in named if target is not None]
    loras = _lora_modules(model, prefix) if peft else {}
    gather = nullcontext
    if zero3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters
    for _, group in itertools.groupby(named, key=lambda item: block_of(item[0])):
        group = list(group)
        params = [param for _, param in group] + [p for target, _ in group if target in loras
                                                  for p in loras[target].parameters()]
        with gather(list({id(p): p for p in params}.values())):  # a LoRA layer's parameters include its base
            for target, param in group:
                lora = loras.get(target)
                delta = 0 if lora is None else sum(lora.get_delta_weight(a) for a in lora.active_adapters
                                                   if a in lora.lora_A)
                if torch.is_tensor(delta):
                    yield target, param.data + delta.to(param.dtype)
                else:
                    yield target, param.data.clone() if zero3 else param.data


def repack_tied_layers(model: torch.nn.Module) -> None:
    """Run vLLM's post-load processing again on each layer whose weight is another layer's (a tied ``lm_head``). On
    CPU that processing packs a copy of the weight for its GEMM kernels; a reload processes the embedding it loads
    but places the tied head back as it was, so the head kept multiplying by the old packed copy (measured on
    Qwen3.5 in bfloat16: greedy answers unlike an engine started on the same weights)."""
    owners: set[int] = set()
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        if id(weight) in owners:
            method = getattr(module, "quant_method", None)
            if method is None or not hasattr(method, "process_weights_after_loading"):
                raise RuntimeError(f"vLLM {vllm_version()}: {type(module).__name__} shares its weight but has no "
                                   "quant_method.process_weights_after_loading to repack it after a weight sync")
            method.process_weights_after_loading(module)
        owners.add(id(weight))


class _ReloadNoise(logging.Filter):
    """Drops vLLM's 'Failed to load weights' for layers that hold no checkpoint weights (rotary tables, the image
    normaliser): a reload places their tensors back, and each sync would log them again."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith(": Failed to load weights") and message.split(":")[0] in NO_CHECKPOINT_LAYERS)


def quiet_reload_noise() -> None:
    """Filter vLLM's reload log once per process (``_ReloadNoise``)."""
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _ReloadNoise) for f in reload_logger.filters):
        reload_logger.addFilter(_ReloadNoise())


def sync_weights(llm: Any, model: Any, zero3: bool = False, cpu: bool = False) -> None:
    """Push the training weights into ``llm`` through vLLM's in-place reload (``reload_weights``: one layerwise reload
    per sync, the kernel tensors and CUDA graphs kept), then drop what the old weights computed: the prefix cache and
    the encoder cache (the reload clears the runner's vision outputs but not the scheduler's record of them: the next
    image seen before would be an 'Encoder cache miss')."""
    with torch.no_grad():
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": engine_weights(model, zero3),
                                                     "is_checkpoint_format": True})
    if cpu:
        llm.apply_model(repack_tied_layers)
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    if not hasattr(engine, "reset_encoder_cache"):
        raise RuntimeError(f"vLLM {vllm_version()}: LLMEngine.reset_encoder_cache is gone; the GRPO rollout engine "
                           "needs it after each weight sync")
    engine.reset_encoder_cache()
