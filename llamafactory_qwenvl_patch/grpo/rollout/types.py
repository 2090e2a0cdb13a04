"""What one rollout produces: each prompt's meta, each sampled micro-batch (``SampledPart``, or ``AgentPart`` for a
multi-turn agent run) and each micro-batch ready to be optimised (``MicroBatch``).

A completion is one model segment after its prompt (the sampled answer with its stop token, trained). A multi-turn
agent's ``Trajectory`` lays out model segments between environment segments (observations rendered by LF's
template, never trained), each with its images: ``Trajectory.rows`` gives the ids and the loss mask such a trajectory
trains with, in the completion rows ``MicroBatch`` already carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal

import torch

Kept = Callable[[list[list[float]]], torch.Tensor]  # per-token values of each trajectory -> (N, K) at the kept places


@dataclass
class SampleMeta:
    """What rewards need about one prompt, captured before LF's collator turns paths into tensors."""

    index: int
    prompt: str
    reference: str
    orig_hw: tuple[int, int] | None
    model_hw: tuple[int, int] | None = None
    blank: bool = False  # sampled with every image blanked (image-reliance control)
    meta: Any = None  # the record's ``meta`` (qwenvl-prep convert keeps it), decoded
    images: list[Any] | None = None  # model-input images, for a vLLM rollout
    videos: list[Any] | None = None  # the training clips (``vllm_video.VideoClip``), for a vLLM rollout


@dataclass
class SampledPart:
    """One micro-batch's prompts, sampled G times each: the rows every later stage (scoring, dynamic sampling's
    swaps, the training inputs, the loss) reads. ``features`` and ``batch`` are held until the training inputs are
    built (a swap collates the prompts again), then dropped."""

    features: list[dict[str, Any]] | None  # LF's raw features of the prompts
    batch: dict[str, Any] | None  # the prompts collated (generation inputs)
    meta: list[SampleMeta]
    texts: list[str]  # G per prompt, in prompt order
    ids: torch.Tensor  # (N x G, T) completion ids, padded after the stop token
    attention: torch.Tensor  # (N x G, T): 1 up to and including the stop token
    stopped: torch.Tensor  # (N x G,): the completion ended with a stop token
    sampling_logps: torch.Tensor | None  # the sampler's (vLLM's) log-probs, when it is not the model
    inputs: dict[str, Any] | None = None  # the training passes' inputs, once built
    old_logps: torch.Tensor | None = None  # off-policy: the log-probs at sampling time
    ref_logps: torch.Tensor | None = None  # with a KL term: the reference's log-probs

    def finish(self, inputs: dict[str, Any], old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None) -> None:
        """Keep the training inputs and log-probs; the raw prompts are held by ``inputs`` where still needed."""
        self.inputs, self.old_logps, self.ref_logps = inputs, old_logps, ref_logps
        self.features = self.batch = None


@dataclass
class AgentPart:
    """One micro-batch of an agent run: its tasks' G trajectories each and their training inputs, with the targets and
    loss mask at the kept positions (the action tokens' predictions)."""

    episodes: list[Any]  # ``generation.agent_episodes.Episode``, G per task, in task order
    meta: list[SampleMeta]  # one per task
    inputs: dict[str, Any]  # the training passes' inputs (packed rows or one row per trajectory)
    targets: torch.Tensor  # (N, K) the action tokens predicted at the kept positions
    mask: torch.Tensor  # (N, K): 1 on an action token
    kept: Kept  # maps per-token values of each trajectory to the kept positions
    old_logps: torch.Tensor | None = None  # off-policy: the log-probs at sampling time
    ref_logps: torch.Tensor | None = None  # with a KL term: the reference's log-probs
    sampling_logps: torch.Tensor | None = None  # the sampler's (vLLM's) log-probs, when it is not the model


@dataclass
class MicroBatch:
    """One micro-batch of a rollout, ready to be optimised (possibly several times)."""

    inputs: dict[str, torch.Tensor]  # prompt + completion forward inputs (images repeated per completion)
    completion_ids: torch.Tensor  # (N, T)
    mask: torch.Tensor  # (N, T): completion tokens that enter the loss
    advantages: torch.Tensor  # (N,)
    old_logps: torch.Tensor | None  # None: on-policy, the detached current log-probs
    ref_logps: torch.Tensor | None
    token_normalizer: float
    seq_normalizer: float
    sampling_logps: torch.Tensor | None = None  # the sampler's (vLLM's) log-probs, when it is not the model


@dataclass(frozen=True)
class Segment:
    """A run of tokens in a trajectory: ``model`` tokens were sampled and are trained; ``env`` tokens render what
    the environment answered (text and the pads of ``images``) and are never trained."""

    kind: Literal["model", "env"]
    ids: tuple[int, ...]
    images: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("model", "env"):
            raise ValueError(f"a segment is 'model' or 'env', got {self.kind!r}")


@dataclass(frozen=True)
class Trajectory:
    """Everything after a prompt: its segments in order. A single-turn completion is one model segment. ``end``
    names why a trajectory stopped (``turns.CONTEXT``, an environment's end), None while it runs."""

    segments: tuple[Segment, ...] = field(default_factory=tuple)
    end: str | None = None

    @property
    def length(self) -> int:
        """Its tokens, every segment's."""
        return sum(len(segment.ids) for segment in self.segments)

    def extended(self, *segments: Segment) -> Trajectory:
        """The same trajectory with ``segments`` appended (an ended one takes none)."""
        if self.end is not None:
            raise ValueError(f"the trajectory ended ({self.end}): nothing follows its last segment")
        return replace(self, segments=self.segments + segments)

    def ended(self, end: str) -> Trajectory:
        """The same segments, stopped for ``end``."""
        return replace(self, end=end)

    def rows(self) -> tuple[list[int], list[int]]:
        """(ids, loss mask): the segments' ids in order, 1 on model tokens and 0 on environment tokens."""
        ids: list[int] = []
        mask: list[int] = []
        for segment in self.segments:
            ids += segment.ids
            mask += [int(segment.kind == "model")] * len(segment.ids)
        return ids, mask

    @property
    def images(self) -> list[Any]:
        """The images the environment showed, in order (the prompt's are not in a trajectory)."""
        return [image for segment in self.segments for image in segment.images]
