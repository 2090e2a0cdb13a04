"""How an agent run plays its tasks (``grpo_agent_env``): each record as a task, the environment slots kept across
rollouts, one seed per task and rollout, and the sampler every turn's actions come from (HF generation or the vLLM
engine). A rollout of tasks is entered by every rank together; within it each rank plays its trajectories for as
many turns as they last, so nothing in it is a collective: under ZeRO-3 the weights are gathered once for all its
turns, and a vLLM engine's weights are synced before its first turn. The one exception is a tensor-parallel engine,
whose every call is a collective of its ranks: there all ranks take each turn together, while any has a live
trajectory (a rank with none joins the call with no request).
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers import TrainerCallback

from llamafactory_qwenvl_patch.agent.runner import EnvRunner, describe_task
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.grpo.generation.agent_episodes import (
    Episode,
    EpisodeSettings,
    Sampled,
    Sampler,
    Task,
    run_episodes,
)
from llamafactory_qwenvl_patch.grpo.generation.zero3_hooks import start_of_forward_hook_removed
from llamafactory_qwenvl_patch.grpo.rollout.meta import META_COLUMN, TASK_COLUMN, decode_meta
from llamafactory_qwenvl_patch.grpo.rollout.tensors import decode_kept
from llamafactory_qwenvl_patch.grpo.rollout.turns import TurnRenderer
from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta

SEED_MODULUS = 2**31 - 1


@dataclass(frozen=True)
class AgentRun:
    """An agent run's settings (the ``grpo_agent_*`` keys) and its turn renderer."""

    env: str
    env_kwargs: dict[str, Any]
    max_turns: int
    max_tokens: int
    step_timeout: float
    isolation: str
    max_env_failures: float
    renderer: TurnRenderer
    credit: str = "trajectory"  # or "gigpo": a step advantage within anchor-state groups (``step_credit``)
    step_weight: float = 1.0
    gamma: float = 0.95

    @property
    def policy(self) -> ResizePolicy:
        return self.renderer.policy


class AgentShutdown(TrainerCallback):
    """Stop the environments' worker processes when training ends."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._agent_shutdown()


class AgentPlayMixin:
    agent: AgentRun | None = None

    # --- tasks and environments ------------------------------------------------------------------------------------

    def _agent_tasks(self, features: list[dict[str, Any]]) -> tuple[list[Task], list[SampleMeta]]:
        """Each record as a task (its meta, prompt, system and tools) and its SampleMeta for the rewards."""
        tasks, meta = [], []
        for feature in features:
            index = int(feature["grpo_index"])
            for media in ("videos", "images", "audios"):
                if feature.get(media):
                    raise ValueError(f"dataset record {index} has {media}: in an agent run (grpo_agent_env) a "
                                     "record is a task, and its screenshots come from the environment")
            if not feature.get(TASK_COLUMN):
                raise RuntimeError("the records reached the agent rollout without their prompt messages; please "
                                   "report this")
            task = json.loads(feature[TASK_COLUMN])
            record_meta = decode_meta(feature.get(META_COLUMN))
            labels = [t for t in feature.get("labels") or [] if t >= 0]
            name = f"record {index}" + (f" ({describe_task(record_meta)})" if record_meta is not None else "")
            tasks.append(Task(record_meta if record_meta is not None else {}, task["prompt"], task["system"],
                              task["tools"], name))
            meta.append(SampleMeta(index, task["prompt"][-1]["content"],
                                   decode_kept(self.tokenizer, labels, self.drop_ids).strip(), None,
                                   meta=record_meta))
        return tasks, meta

    def _agent_runners(self, count: int) -> list[EnvRunner]:
        """``count`` environment slots, kept across rollouts (their workers are reused)."""
        pool, agent = self.run_state.agent_pool, self.agent
        while len(pool) < count:
            pool.append(EnvRunner(agent.env, agent.env_kwargs, policy=agent.policy, isolation=agent.isolation,
                                  timeout=agent.step_timeout))
        return pool[:count]

    def _agent_shutdown(self) -> None:
        for runner in self.run_state.agent_pool:
            runner.shutdown()

    def _agent_seed(self, index: int, part: int | None) -> int:
        """One seed per task and rollout, from (run seed, rank, micro-step, part, record): the G members start on one
        screen, and a relaunch redraws the same tasks. ``part`` None (an evaluation): from (run seed, record) alone,
        so every evaluation plays each task on the same screens and compares checkpoints on equal terms."""
        if part is None:
            return (self.args.seed * 1_000_003 + index) % SEED_MODULUS
        key = (((self.args.seed * 1_000_003 + self.args.process_index) * 1_000_003 + self.run_state.micro_step)
               * 97 + part) * 1_000_003 + index
        return key % SEED_MODULUS

    def _agent_settings(self) -> EpisodeSettings:
        return EpisodeSettings(self.agent.policy, self.coords, self.agent.max_turns, self.agent.max_tokens,
                               self.max_new_tokens)

    # --- sampling --------------------------------------------------------------------------------------------------

    @contextmanager
    def _agent_generation(self, model: Any) -> Iterator[Any]:
        """What one rollout of tasks samples with, entered by every rank together (the number of rollouts is the same
        on every rank; within one, each rank plays its trajectories for as many turns as they last, so nothing in it
        may be a collective): the vLLM engine, its weights synced here once per optimiser step; else the model of
        ``_generation_model``, whose ZeRO-3 gather is entered once for all the turns, with DeepSpeed's
        start-of-forward hook set aside (``generation.zero3_hooks``)."""
        if self.vllm is not None:
            if self.run_state.vllm_step != self.state.global_step:
                self._sync_weights(model)
                self.run_state.vllm_step = self.state.global_step
            yield model
            return
        with self._generation_model(model) as unwrapped:
            if not self._zero3():
                yield unwrapped
                return
            with start_of_forward_hook_removed(model):  # its collectives would pair the ranks' forwards wrongly
                yield unwrapped

    def _agent_sampler(self, model: Any, meta: list[SampleMeta], greedy: bool = False) -> Sampler:
        """One action per row, on whole rows with all their screenshots: HF ``generate`` on the model of
        ``_agent_generation`` (rows left-padded; the model computes each row's positions itself, since every row
        starts at its task's root) or the vLLM engine (its frame guard checks every screenshot of every turn)."""
        config = copy.deepcopy(self.greedy_config if greedy else self.generation_config)
        config.num_return_sequences = 1
        pad = self.tokenizer.pad_token_id

        def sample(rows: list[list[int]], images: list[list[Any]], tasks: list[int]) -> Sampled:
            if self.vllm is not None:
                out = self.vllm.generate(rows, images, [meta[t].index for t in tasks], pad, greedy=greedy, n=1)
                if not rows:  # this rank's trajectories ended; it joined its tensor-parallel engine's call
                    return [], [], [], []
                sampled, logps = out.ids, out.logps.tolist()
            else:
                # the first turn's G rows of a task are its root: with the shared prefix it is prefilled once and
                # sampled G times (sample_shared_prefix), as single answers are
                group = self.num_generations if self.shared_prefix and _repeated(rows, self.num_generations) else 1
                unique, unique_images = rows[::group], images[::group]
                width = max(len(row) for row in unique)
                batch: dict[str, Any] = {
                    "input_ids": torch.tensor([[pad] * (width - len(row)) + row for row in unique]),
                    "attention_mask": torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in unique]),
                }
                visual = self.agent.renderer.processor.image_processor(
                    images=[i for row in unique_images for i in row], return_tensors="pt")
                batch["pixel_values"], batch["image_grid_thw"] = visual["pixel_values"], visual["image_grid_thw"]
                turn_config = config
                if group > 1:
                    turn_config = copy.copy(config)
                    turn_config.num_return_sequences = group
                    if not greedy:
                        self.run_state.metrics["agent/shared_roots"].append(float(len(unique)))
                # the ranks are not in step here (each plays its trajectories for as many turns as they last): no
                # synced loop, which under ZeRO-3 generate would otherwise run
                sampled = self._generate_on(model, self._prepare_input(batch), turn_config, synced_gpus=False)
                logps = None
            ids, mask, stopped, texts, _ = self._completions(sampled)
            lengths = mask.sum(dim=1).tolist()
            return [row[:n] for row, n in zip(ids.tolist(), lengths)], stopped.tolist(), texts, logps

        return sample

    def _agent_episodes(self, model: Any, features: list[dict[str, Any]], part: int | None, G: int,
                        greedy: bool = False) -> tuple[list[Episode], list[SampleMeta]]:
        tasks, meta = self._agent_tasks(features)
        seeds = [self._agent_seed(m.index, part) for m in meta]
        # a tensor-parallel engine's calls are collectives: its ranks take the turns together
        in_step = self._any_rank if self.vllm is not None and self.vllm.tp_group is not None else None
        with self._agent_generation(model) as sampler_model:
            episodes = run_episodes(tasks, G, self._agent_runners(len(tasks) * G), seeds, self.agent.renderer,
                                    self._agent_sampler(sampler_model, meta, greedy), self._agent_settings(), in_step)
        self._log_close_error(episodes)
        for m, e in zip(meta, episodes[::G]):  # the frame of the task's first screen
            if e.turns:
                m.orig_hw, m.model_hw = tuple(e.turns[0]["orig_hw"]), tuple(e.turns[0]["model_hw"])
        return episodes, meta


def _repeated(rows: list[list[int]], group: int) -> bool:
    """Whether ``rows`` are runs of ``group`` equal rows (a rollout's first turn, every reset alive)."""
    return group > 1 and len(rows) % group == 0 and all(row == rows[i - i % group] for i, row in enumerate(rows))
