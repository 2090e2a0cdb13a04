"""Whether HF rollouts can gather the whole model under ZeRO-3 on this GPU, said before the first rollout.

HF ``generate`` (and the shared-prefix sampler) needs every weight on every rank at once, so under ZeRO-3 each rank
gathers the full model for the rollout (``unwrap_model_for_generation(gather_deepspeed3_params=True)``): a 72B model
is 145 GB in bf16 per GPU, on top of the rank's shard, optimiser state and activations. The run would die at the
first rollout with a CUDA out-of-memory error after minutes of loading; here it stops at start with the numbers, or
warns where it is close, and points to the vLLM rollout backend (tensor-parallel, no full gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30
WARN_SHARE = 0.8  # warn when the gather would take more than this share of the free memory


@dataclass(frozen=True)
class GatherBudget:
    model_bytes: int  # the whole model, gathered
    local_bytes: int  # this rank's shard, already resident
    free_bytes: int  # free device memory now
    total_bytes: int  # device memory

    @property
    def extra_bytes(self) -> int:
        """What the gather adds to the device: the model less the shard the rank holds."""
        return max(0, self.model_bytes - self.local_bytes)

    def verdict(self) -> tuple[str, str] | None:
        """("error" | "warning", message), or None where the gather fits with room to spare."""
        need, free = self.extra_bytes, self.free_bytes
        if need <= WARN_SHARE * free:
            return None
        numbers = (f"gathering the whole model for HF rollouts under ZeRO-3 takes {need / GIB:.1f} GiB more per GPU "
                   f"({self.model_bytes / GIB:.1f} GiB model, {self.local_bytes / GIB:.1f} GiB of it already on this "
                   f"rank); {free / GIB:.1f} of {self.total_bytes / GIB:.1f} GiB are free")
        advice = ("use grpo_rollout_backend: vllm (with grpo_vllm_tensor_parallel_size for large models), which "
                  "never gathers the whole model, or fewer, larger GPUs per model copy")
        if need > free:
            return "error", f"{numbers}: it cannot fit; {advice}"
        return "warning", (f"{numbers}: activations and the KV cache of the rollout must fit in the rest, so it "
                           f"may run out of memory; {advice}")


def parameter_bytes(model: Any) -> tuple[int, int]:
    """(bytes of the whole model, bytes of this rank's shard): DeepSpeed ZeRO-3 gives each parameter ``ds_numel``
    (its full size) and ``ds_tensor`` (the local partition); an unpartitioned parameter counts whole in both."""
    whole = local = 0
    for param in model.parameters():
        size = param.element_size()
        whole += int(getattr(param, "ds_numel", param.numel())) * size
        shard = getattr(param, "ds_tensor", None)
        local += (shard.numel() if shard is not None else param.numel()) * size
    return whole, local


def zero3_budget(model: Any, device: Any) -> GatherBudget:
    """The budget of a ZeRO-3 partitioned ``model`` on a CUDA ``device``, with its free memory now."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return GatherBudget(*parameter_bytes(model), int(free), int(total))
