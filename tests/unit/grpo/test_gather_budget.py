"""HF rollouts under ZeRO-3 gather the whole model on every rank: the budget is checked before the first rollout.
The verdict is pure arithmetic (no GPU here); the numbers are those of a 72B model in bf16 on 80 GB GPUs."""

from __future__ import annotations

from llamafactory_qwenvl_patch.grpo.generation.gather_budget import GIB, GatherBudget


def test_a_72b_gather_on_80_gb_cannot_fit_and_names_the_numbers_and_vllm():
    budget = GatherBudget(model_bytes=int(145.4 * GIB), local_bytes=int(4.5 * GIB), free_bytes=int(50 * GIB),
                          total_bytes=int(79.3 * GIB))
    level, message = budget.verdict()
    assert level == "error"
    assert "140.9 GiB more per GPU" in message and "145.4 GiB model" in message and "50.0 of 79.3 GiB" in message
    assert "grpo_rollout_backend: vllm" in message


def test_a_gather_near_the_free_memory_warns_and_one_with_room_passes():
    close = GatherBudget(model_bytes=int(15 * GIB), local_bytes=int(2 * GIB), free_bytes=int(15 * GIB),
                         total_bytes=int(80 * GIB))
    assert close.verdict()[0] == "warning"
    roomy = GatherBudget(model_bytes=int(15 * GIB), local_bytes=int(2 * GIB), free_bytes=int(60 * GIB),
                         total_bytes=int(80 * GIB))
    assert roomy.verdict() is None
    assert GatherBudget(10, 20, 0, 0).extra_bytes == 0  # an unpartitioned model gathers nothing more


def test_parameter_bytes_reads_zero3_partition_sizes():
    """ZeRO-3 leaves each parameter empty with its full size in ``ds_numel`` and the rank's part in ``ds_tensor``
    (DeepSpeed's attributes, set here on a real module as DeepSpeed sets them)."""
    import torch

    from llamafactory_qwenvl_patch.grpo.generation.gather_budget import parameter_bytes

    layer = torch.nn.Linear(8, 4, bias=False, dtype=torch.bfloat16)
    assert parameter_bytes(layer) == (64, 64)
    layer.weight.ds_numel = 4000
    layer.weight.ds_tensor = torch.empty(1000, dtype=torch.bfloat16)
    assert parameter_bytes(layer) == (8000, 2000)
