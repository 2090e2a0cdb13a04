"""``GRPOTrainer``'s own state, declared in one place: what the mixins read and write between micro-steps, and what
a checkpoint saves of it (``checkpoint``)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from llamafactory_qwenvl_patch.grpo.rollout.types import MicroBatch
from llamafactory_qwenvl_patch.scoring.clicks import ClickMonitorTally
from llamafactory_qwenvl_patch.scoring.detection import MonitorTally
from llamafactory_qwenvl_patch.scoring.temporal import SpanMonitorTally


@dataclass
class RunState:
    """Saved with each checkpoint: ``buffer`` (inside a reuse window), ``micro_step``, ``metrics``,
    ``flat_rollouts``, ``reported_rewards``. The rest lives for one process."""

    buffer: list[MicroBatch] | None = None  # the rollout's micro-batches, optimised in turn
    micro_step: int = 0  # micro-steps since the run began (a resume restores it)
    metrics: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # since the last log
    reported_rewards: set[str] = field(default_factory=set)  # rewards whose first failure was logged
    flat_rollouts: int = 0  # rollouts in a row in which every group's rewards were all equal
    monitors: MonitorTally = field(default_factory=MonitorTally)  # detection-hack counts since the last log
    span_monitors: SpanMonitorTally = field(default_factory=SpanMonitorTally)  # and the span hacks'
    click_monitors: ClickMonitorTally | None = None  # and, in a run rewarded for clicks, theirs
    vllm_step: int = -1  # the global step whose weights the vLLM engine holds
    cuda_peak: int = 0  # the CUDA peak before the last weight sync reset it
    gather_checked: bool = False  # HF rollouts under ZeRO-3: the whole-model gather checked against the GPU
    first_pass: bool = True  # the current micro-step is the first pass over its rollout
    agent_pool: list[Any] = field(default_factory=list)  # an agent run's environment slots (``EnvRunner``), reused
    agent_failure_logged: bool = False  # an agent run's first environment failure was logged
    agent_close_logged: bool = False  # and its first failed close()


class AcceleratorRanks:
    """The estimators' view of the other ranks (``advantages.Ranks``), through accelerate."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.several = accelerator.num_processes > 1

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(values)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(values, reduction="sum")
