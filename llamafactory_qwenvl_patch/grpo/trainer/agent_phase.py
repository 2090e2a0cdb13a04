"""The rollout of a multi-turn agent run (``grpo_agent_env``): each record is a task, rolled out G times against
the environment (``generation.agent_episodes``), scored per trajectory and trained on its action tokens only: one
packed row per task with the shared prefix (the task's root once, each trajectory behind it), else one row per
trajectory (``rollout.agent_rows``).

Advantages: the configured estimator over the G trajectories of a task, broadcast to every action token. A
trajectory ended by an environment failure gets no loss and leaves its group's baseline: its reward is set to the
mean of the group's other members before the estimator runs, and a group with fewer than two others gets no loss.
"Sequence" in a loss means the trajectory.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from llamafactory_qwenvl_patch.agent.runner import ENV_TIMEOUT
from llamafactory_qwenvl_patch.frame.mrope import token_types
from llamafactory_qwenvl_patch.grpo.algorithm.dynamic_sampling import flat_groups, fresh_indices
from llamafactory_qwenvl_patch.grpo.algorithm.losses import micro_batch_counts, step_normalizers
from llamafactory_qwenvl_patch.grpo.algorithm.step_credit import grouped_share, step_advantages
from llamafactory_qwenvl_patch.grpo.generation.agent_episodes import DONE, Episode, trie_saving
from llamafactory_qwenvl_patch.grpo.rewards.monitors import rollout_metrics
from llamafactory_qwenvl_patch.grpo.rewards.registry import Scored, pick_scored, reward_inputs, score
from llamafactory_qwenvl_patch.grpo.rollout import shared_prefix
from llamafactory_qwenvl_patch.grpo.rollout.agent_rows import (
    ACTION_INDEX,
    action_values,
    packed_trajectory_inputs,
    suffix_values,
    trajectory_inputs,
)
from llamafactory_qwenvl_patch.grpo.rollout.types import AgentPart, Kept, MicroBatch, SampleMeta
from llamafactory_qwenvl_patch.grpo.trainer.agent_play import AgentPlayMixin

logger = logging.getLogger("llamafactory.qwenvl_patch.grpo")


class ScoredTasks(NamedTuple):
    """One micro-batch of tasks for dynamic sampling: their G trajectories each, their meta, each reward's values
    over the trajectories and which tasks' groups are flat."""

    episodes: list[Episode]
    meta: list[SampleMeta]
    results: list[Scored]
    flat: list[bool]


class AgentMixin(AgentPlayMixin):
    def _agent_inputs(self, episodes: list[Episode]) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, Kept]:
        """The trajectories' training inputs, and their targets and mask at the kept positions: one packed row per
        task with the shared prefix (its root once), else one row per trajectory. ``kept`` maps per-token values of
        each trajectory (aligned with its ids after the root) to those positions (the sampler's log-probs, GiGPO's
        token advantages)."""
        pad, image_processor = self.tokenizer.pad_token_id, self.agent.renderer.processor.image_processor
        if self.shared_prefix:
            G = self.num_generations
            groups = []
            for start in range(0, len(episodes), G):
                members = episodes[start:start + G]
                root = next((e.root for e in members if e.root is not None), None)
                if any(e.root is not None and list(e.root.ids) != list(root.ids) for e in members):
                    raise RuntimeError("the trajectories of one task start from different roots; please report this")
                packed = [(*e.trajectory.rows(), list(e.trajectory.images)) if e.root is not None else ([], [], [])
                          for e in members]
                groups.append(([], [], packed) if root is None else (list(root.ids), list(root.images), packed))
            inputs, targets, mask, index = packed_trajectory_inputs(self.model, groups, image_processor, pad, G,
                                                                    self._agent_dummy())
            width = inputs[shared_prefix.KWARG].completion_length

            def kept(values: list[list[float]]) -> torch.Tensor:
                return suffix_values(values, width, index)
        else:
            rows = [([], [], []) if e.root is None else _row(e) for e in episodes]  # failed at reset: no loss
            inputs, targets, mask = trajectory_inputs(self.model, rows, image_processor, pad, self._agent_dummy())
            width, index = inputs["input_ids"].size(1), inputs[ACTION_INDEX]
            roots = [len(e.root.ids) if e.root is not None else 0 for e in episodes]

            def kept(values: list[list[float]]) -> torch.Tensor:
                return action_values([[0.0] * n + v if v else [] for n, v in zip(roots, values)], width, index)
        if self.pass_token_types:
            inputs["mm_token_type_ids"] = token_types(inputs["input_ids"], self.model.config)
        inputs = self._prepare_input(inputs)
        device = inputs["input_ids"].device
        return inputs, targets.to(device), mask.to(device), lambda values: kept(values).to(device)

    def _agent_dummy(self) -> tuple[list[int], Any] | None:
        """Under ZeRO-3 on several ranks: a blank screenshot in the pinned frame and its tokens, for a micro-batch
        with no screenshot (every task of it failed at reset). The vision tower's weights are gathered by all ranks
        together as each runs it, so a rank that skipped it would wait forever; it runs it on this, masked, as LF's
        collator adds a fake image for the same reason."""
        if not (self._zero3() and self.accelerator.num_processes > 1):
            return None
        from PIL import Image

        policy, config = self.agent.policy, self.model.config
        height, width = policy.model_size(policy.factor, policy.factor)
        pads = [config.image_token_id] * policy.image_tokens(height, width)
        return ([config.vision_start_token_id, *pads, config.vision_end_token_id],
                Image.new("RGB", (width, height), (128, 128, 128)))

    # --- the rollout -----------------------------------------------------------------------------------------------

    def _agent_rollout(self, model: Any, features: list[dict[str, Any]]) -> list[MicroBatch]:
        G, spg = self.num_generations, self.steps_per_generation
        per_micro = len(features) // spg
        model.train()
        dynamic = self.grpo_args.grpo_dynamic_sampling
        sampled, parts = [], []
        for j in range(spg):
            sampled.append(self._agent_episodes(model, features[j * per_micro:(j + 1) * per_micro], j, G))
            if not dynamic:  # each part's inputs right after its episodes, as a run without refills always did
                parts.append(self._agent_part(model, *sampled[-1]))
        picked = None
        if dynamic:
            sampled, picked = self._agent_refill(model, sampled, per_micro)
            parts = [self._agent_part(model, episodes, meta) for episodes, meta in sampled]
        episodes = [e for part in parts for e in part.episodes]
        meta = [m for part in parts for m in part.meta]
        device = parts[0].inputs["input_ids"].device
        failed = torch.tensor([e.failed for e in episodes], device=device)
        self._check_env_failures(episodes, failed)
        texts = [e.actions_text for e in episodes]
        lengths = torch.cat([part.mask.sum(dim=1) for part in parts]).float()  # action tokens per trajectory
        results = picked if picked is not None else self._agent_scores(episodes, meta, lengths.tolist())
        rewards = self._score(texts, meta, [int(n) for n in lengths.tolist()], results).to(device)
        baseline_rewards, usable = _leave_failures_out(rewards, failed, G)
        adv = self._advantages(baseline_rewards, lengths)
        bounds = torch.tensor([0] + [len(part.episodes) for part in parts]).cumsum(0).tolist()
        advantages = [adv[bounds[j]:bounds[j + 1]] for j in range(len(parts))]
        if self.agent.credit == "gigpo":
            advantages = self._step_credit(episodes, adv, usable, parts, bounds)
        keep = usable.clone()
        stopped = torch.tensor([e.cut == 0 for e in episodes], device=device)  # no action cut at max_new_tokens
        if self.grpo_args.grpo_skip_zero_std_groups:
            from llamafactory_qwenvl_patch.grpo.algorithm.advantages import zero_std_groups

            flat = zero_std_groups(baseline_rewards, G)
            keep &= ~flat
            self.run_state.metrics["groups_skipped"].append(float(flat.sum()) / G)
        if self.grpo_args.grpo_mask_truncated:
            keep &= stopped
        masks = [part.mask * keep[bounds[j]:bounds[j + 1]].unsqueeze(1).long() for j, part in enumerate(parts)]
        counts = micro_batch_counts(masks).to(device)
        counts = self.accelerator.reduce(counts, reduction="sum") if self.accelerator.num_processes > 1 else counts
        norms = step_normalizers(counts, self.grad_accum, self.accelerator.num_processes).tolist()
        stats = _logged_stats(rewards, baseline_rewards, usable, lengths, stopped, texts, meta, G)
        for key, value in {**stats, **_agent_metrics(episodes, G)}.items():
            self.run_state.metrics[key].append(value)
        self._warn_if_flat(stats, texts, meta)
        if self.grpo_args.grpo_log_completions:
            self._log_completions(texts, rewards.tolist(), meta, [e.record() for e in episodes])
        return [MicroBatch(inputs=part.inputs, completion_ids=part.targets, mask=masks[j],
                           advantages=advantages[j], old_logps=part.old_logps, ref_logps=part.ref_logps,
                           token_normalizer=norms[j][0], seq_normalizer=norms[j][1],
                           sampling_logps=part.sampling_logps)
                for j, part in enumerate(parts)]

    def _agent_part(self, model: Any, episodes: list[Episode], meta: list[SampleMeta]) -> AgentPart:
        """One micro-batch's trajectories as training inputs, with the old and reference log-probs where needed."""
        inputs, targets, mask, kept = self._agent_inputs(episodes)
        sampling = kept([_sampled_values(e) for e in episodes]) if self.vllm is not None else None
        with torch.no_grad(), self._shared_attention():
            old = self._token_logps(model, inputs, targets)[0] if self.off_policy else None
            ref = self._reference_logps(model, inputs, targets) if self.grpo_args.grpo_beta != 0 else None
        return AgentPart(episodes, meta, inputs, targets, mask, kept, old, ref, sampling)

    def _agent_scores(self, episodes: list[Episode], meta: list[SampleMeta], lengths: list[float]) -> list[Scored]:
        """Each reward's values over ``episodes`` (G per task of ``meta``; ``lengths``: their action tokens)."""
        texts = [e.actions_text for e in episodes]
        columns, shared = reward_inputs(meta, self.num_generations, self.agent.policy, self.coords,
                                        [int(n) for n in lengths], self.loss_config.max_completion_length, None)
        columns["trajectories"] = [e.record() for e in episodes]
        return [score(reward, texts, columns, shared) for reward in self.reward_funcs]

    def _agent_flat(self, episodes: list[Episode], results: list[Scored]) -> list[bool]:
        """Per task: its group teaches nothing: every usable trajectory got one total reward (a failed one stands at
        its group's mean), or fewer than two are usable."""
        G = self.num_generations
        if not episodes:
            return []
        failed = torch.tensor([e.failed for e in episodes])
        baseline, usable = _leave_failures_out(self._weighted_total(results, len(episodes)), failed, G)
        unusable = ~usable.view(-1, G).any(dim=1)
        return [flat or none for flat, none in zip(flat_groups(baseline, G), unusable.tolist())]

    def _agent_refill(self, model: Any, sampled: list[tuple[list[Episode], list[SampleMeta]]], per_micro: int
                      ) -> tuple[list[tuple[list[Episode], list[SampleMeta]]], list[Scored]]:
        """DAPO's dynamic sampling over tasks (``dynamic_sampling``'s rules): each flat group of trajectories is
        swapped for the G trajectories of a freshly drawn task whose group is not flat, at most
        ``grpo_max_resample`` extra micro-batches of tasks; returns the parts and each reward's values over their
        final trajectories in order."""
        G = self.num_generations
        sources = [self._scored_tasks(episodes, meta) for episodes, meta in sampled]
        slots = [(j, k) for j, source in enumerate(sources) for k, flat in enumerate(source.flat) if flat]
        candidates: list[tuple[int, int]] = []
        attempts = 0
        while attempts < self.grpo_args.grpo_max_resample and self._any_rank(len(slots) > len(candidates)):
            indices = fresh_indices(len(self.train_dataset), per_micro, self.args.seed, self.args.process_index,
                                    self.run_state.micro_step, attempts)
            sources.append(self._scored_tasks(*self._agent_episodes(
                model, [self.train_dataset[i] for i in indices], self.steps_per_generation + attempts, G)))
            attempts += 1
            candidates += [(len(sources) - 1, k) for k, flat in enumerate(sources[-1].flat) if not flat]
        swaps = dict(zip(slots, candidates))
        parts, rows = [], []
        for j, own in enumerate(sources[:len(sampled)]):
            picked_episodes, picked_meta = [], []
            for k in range(len(own.meta)):
                source, kk = swaps.get((j, k), (j, k))
                picked_meta.append(sources[source].meta[kk])
                picked_episodes += sources[source].episodes[kk * G:(kk + 1) * G]
                rows += [(source, kk * G + g) for g in range(G)]
            parts.append((picked_episodes, picked_meta))
        self.run_state.metrics["dynamic/replaced_groups"].append(float(len(swaps)))
        self.run_state.metrics["dynamic/short_groups"].append(float(len(slots) - len(swaps)))
        self.run_state.metrics["dynamic/resampled_batches"].append(float(attempts))
        return parts, pick_scored([source.results for source in sources], rows)

    def _scored_tasks(self, episodes: list[Episode], meta: list[SampleMeta]) -> ScoredTasks:
        """A micro-batch of tasks' trajectories scored, and which tasks' groups are flat (``_agent_flat``)."""
        results = self._agent_scores(episodes, meta, [_action_tokens(e) for e in episodes])
        return ScoredTasks(episodes, meta, results, self._agent_flat(episodes, results))

    def _step_credit(self, episodes: list[Episode], adv: torch.Tensor, usable: torch.Tensor, parts: list[AgentPart],
                     bounds: list[int]) -> list[torch.Tensor]:
        """GiGPO (``algorithm.step_credit``): each part's (N, K) token advantages, the trajectory's advantage plus
        ``step_weight`` x its step's advantage within the steps of its task's group taken from the same state."""
        agent, G = self.agent, self.num_generations
        turns, ok = [e.turns for e in episodes], usable.tolist()
        steps = step_advantages(turns, ok, G, agent.gamma, self.grpo_args.grpo_scale_rewards == "group")
        self.run_state.metrics["agent/step_grouped_share"].append(grouped_share(turns, ok, G))
        per_action = [[float(adv[i]) + agent.step_weight * a for a in row] for i, row in enumerate(steps)]
        return [part.kept([_token_values(e, per_action[bounds[j] + k]) for k, e in enumerate(part.episodes)])
                for j, part in enumerate(parts)]

    def _log_close_error(self, episodes: list[Episode]) -> None:
        """Log the first failed close() once (counted in agent/close_errors): the trajectory is whole, but an
        environment that leaks what close() frees (a VM, a browser) should be seen before it fills the machine."""
        first = next((e for e in episodes if e.close_error), None)
        if first is not None and not self.run_state.agent_close_logged:
            self.run_state.agent_close_logged = True
            logger.warning(f"an environment's close() failed (counted in agent/close_errors, shown once): "
                           f"{first.close_error}")

    def _check_env_failures(self, episodes: list[Episode], failed: torch.Tensor) -> None:
        """Log the first failure once; stop every rank together when the share of failed trajectories (all ranks)
        passes ``grpo_agent_max_env_failures``."""
        counts = torch.tensor([float(failed.sum()), float(len(episodes))], device=failed.device)
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        first = next((e for e in episodes if e.failed), None)
        if first is not None and not self.run_state.agent_failure_logged:
            self.run_state.agent_failure_logged = True
            logger.warning(f"an environment failed ({first.end}; counted in agent/env_errors and "
                           f"agent/env_timeout_errors, shown once): {first.message}")
        share = float(counts[0] / counts[1]) if counts[1] else 0.0
        if share > self.agent.max_env_failures:
            where = first.message if first is not None else "on another rank"
            raise RuntimeError(f"{share:.0%} of this rollout's trajectories ended in an environment failure, above "
                               f"grpo_agent_max_env_failures ({self.agent.max_env_failures:g}); the first: {where}")

    # --- evaluation ------------------------------------------------------------------------------------------------

    def _agent_evaluate(self, dataset: Any, prefix: str) -> dict[str, float]:
        """One greedy trajectory per eval task: each reward's mean, the weighted total and the agent metrics."""
        from accelerate.utils import gather_object

        model = self.model_wrapped
        rows = []
        for inputs in self.get_eval_dataloader(dataset):
            episodes, meta = self._agent_episodes(model, inputs["grpo_features"], None, 1, greedy=True)
            rows += [(m.index, e.actions_text, e.record(), m) for m, e in zip(meta, episodes)]
        unique = {row[0]: row for row in gather_object(rows)}  # even_batches padding repeats records
        rows = list(unique.values())
        texts, records, meta = [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]
        columns, shared = reward_inputs(meta, 1, self.agent.policy, self.coords, None,
                                        self.loss_config.max_completion_length, None)
        columns["trajectories"] = records
        metrics: dict[str, float] = {}
        total = torch.zeros(len(rows))
        for reward in self.reward_funcs:
            values = torch.tensor(score(reward, texts, columns, shared).values)
            metrics[f"{prefix}_rewards/{reward.name}"] = round(float(values.mean()), 6) if rows else 0.0
            total += reward.weight * values
        metrics[f"{prefix}_reward"] = round(float(total.mean()), 6) if rows else 0.0
        done = [r["end"] == DONE for r in records]
        metrics[f"{prefix}_agent/done_rate"] = round(sum(done) / len(done), 6) if done else 0.0
        metrics[f"{prefix}_agent/turns"] = round(sum(len(r["turns"]) for r in records) / len(records), 6) \
            if records else 0.0
        return metrics


def _leave_failures_out(rewards: torch.Tensor, failed: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards for the estimator, trajectories that get a loss): a failed member stands at the mean of its group's
    other members, so it moves neither the baseline nor anyone's advantage sign; it and every member of a group
    with fewer than two usable members get no loss."""
    rewards, failed = rewards.view(-1, G).clone(), failed.view(-1, G)
    ok = ~failed
    count = ok.sum(dim=1, keepdim=True)
    mean = (rewards * ok).sum(dim=1, keepdim=True) / count.clamp(min=1)
    rewards = torch.where(ok, rewards, mean.expand_as(rewards))
    usable = ok & (count >= 2)
    return rewards.view(-1), usable.view(-1)


def _logged_stats(rewards: torch.Tensor, baseline_rewards: torch.Tensor, usable: torch.Tensor, lengths: torch.Tensor,
                  stopped: torch.Tensor, texts: list[str], meta: list[SampleMeta], G: int) -> dict[str, float]:
    """The rollout's reward statistics as the loss sees them: over the groups that get a loss, each failed member at
    its group's mean (so a flaky environment reads as failures, ``agent/env_errors``, not as a worse or more varied
    policy, and a flat group as flat); when no group gets a loss, over every trajectory as scored."""
    trained = usable.view(-1, G).any(dim=1)
    if not bool(trained.any()):
        return rollout_metrics(rewards, lengths, stopped, texts, meta, G)
    rows = trained.repeat_interleave(G)
    return rollout_metrics(baseline_rewards[rows], lengths[rows], stopped[rows],
                           [text for text, keep in zip(texts, rows.tolist()) if keep],
                           [m for m, keep in zip(meta, trained.tolist()) if keep], G)


def _agent_metrics(episodes: list[Episode], G: int) -> dict[str, float]:
    """What the rollout's trajectories did: turns, ends, invalid actions, and the share of tokens a prefix tree over
    each group's trajectories would save (``trie_saving``)."""
    n = len(episodes)
    turns = [len(e.turns) for e in episodes]
    actions = [t for e in episodes for t in e.turns]
    groups = [[e.trajectory.rows()[0] for e in episodes[i:i + G]] for i in range(0, n, G)]
    return {
        "agent/turns/mean": sum(turns) / n,
        "agent/turns/max": float(max(turns)),
        "agent/done_rate": sum(e.end == DONE for e in episodes) / n,
        "agent/context_rate": sum(e.end == "context" for e in episodes) / n,
        "agent/invalid_action_rate": (sum(t["action"]["kind"] == "invalid" for t in actions) / len(actions))
        if actions else 0.0,
        "agent/env_errors": float(sum(e.failed and e.end != ENV_TIMEOUT for e in episodes)),
        "agent/env_timeout_errors": float(sum(e.end == ENV_TIMEOUT for e in episodes)),
        "agent/close_errors": float(sum(bool(e.close_error) for e in episodes)),
        "agent/trie_saving": sum(trie_saving(rows) for rows in groups) / len(groups),
    }


def _row(episode: Episode) -> tuple[list[int], list[int], list[Any]]:
    """A trajectory as one row: its root, then its actions and observations (ids, loss mask, screenshots)."""
    ids, mask = episode.trajectory.rows()
    root = episode.root
    return list(root.ids) + ids, [0] * len(root.ids) + mask, [*root.images, *episode.trajectory.images]


def _action_tokens(episode: Episode) -> int:
    """The tokens of ``episode``'s actions (its trajectory's loss mask), what its training row trains."""
    return sum(episode.trajectory.rows()[1]) if episode.root is not None else 0


def _sampled_values(episode: Episode) -> list[float]:
    """The sampler's log-prob of each action token of ``episode``'s trajectory (0 elsewhere), aligned with its ids."""
    if episode.root is None:
        return []
    logps = iter(episode.sampling_logps)
    return [next(logps, 0.0) if m else 0.0 for m in episode.trajectory.rows()[1]]


def _token_values(episode: Episode, per_action: list[float]) -> list[float]:
    """``per_action[t]`` on every token of the trajectory's action t (0 on observation tokens), aligned with its ids."""
    if episode.root is None:
        return []
    values, actions = [], iter(per_action)
    for segment in episode.trajectory.segments:
        value = next(actions, 0.0) if segment.kind == "model" else 0.0
        values += [value] * len(segment.ids)
    return values
