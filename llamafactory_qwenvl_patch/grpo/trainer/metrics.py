"""What ``GRPOTrainer`` reports: greedy evaluation, the completions log and the step's metrics reduced over
ranks."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from llamafactory_qwenvl_patch.grpo.rewards.builtin import confident_answer
from llamafactory_qwenvl_patch.grpo.rewards.evaluation import eval_metrics
from llamafactory_qwenvl_patch.grpo.rollout.collate import blank_copy, blankable
from llamafactory_qwenvl_patch.grpo.rollout.types import SampleMeta
from llamafactory_qwenvl_patch.scoring.clicks import ClickMonitorTally
from llamafactory_qwenvl_patch.scoring.detection import MonitorTally
from llamafactory_qwenvl_patch.scoring.temporal import SpanMonitorTally

COUNTERS = ("errors", "parse_failures", "vision_tokens_cut", "groups_skipped", "replaced_groups", "short_groups")
COMPLETIONS = "completions.jsonl"


class MetricsMixin:
    # --- evaluation ----------------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Greedy answers to the eval prompts: each reward's mean and, for grounding data, Acc@0.5, mean IoU and
        parse failures in original-image pixels (the metrics of ``qwenvl-prep eval``)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if self.agent is not None:  # one greedy trajectory per task
            return self._logged_eval(self._agent_evaluate(dataset, metric_key_prefix))
        from accelerate.utils import gather_object

        model = self.model_wrapped
        rows = []
        for inputs in self.get_eval_dataloader(dataset):
            features = inputs["grpo_features"]
            if self.grpo_args.grpo_blank_image_ratio > 0:  # every prompt once more on blank images
                features = features + [blank_copy(f) for f in features if blankable(f)]
            batch, meta = self._collate(features)
            _, mask, _, texts, _ = self._completions(self._sample(model, batch, meta, greedy=True)[0])
            rows += list(zip(meta, texts, mask.sum(dim=1).tolist()))
        # drop even_batches padding: one row per (record, blank or not)
        unique = {(row[0].index, row[0].blank): row for row in gather_object(rows)}
        real = [row for row in unique.values() if not row[0].blank]
        metrics = eval_metrics([row[0] for row in real], [row[1] for row in real], self.reward_funcs,
                               self.resize_policy, self.coords, metric_key_prefix,
                               ([row[2] for row in real], self.max_new_tokens, self.grpo_args.grpo_overlong_buffer))
        blank = [confident_answer(text, sample.reference) for sample, text, _ in unique.values() if sample.blank]
        if blank:
            metrics[f"{metric_key_prefix}_blank/confident_rate"] = round(sum(blank) / len(blank), 6)
        return self._logged_eval(metrics)

    def _logged_eval(self, metrics: dict[str, float]) -> dict[str, float]:
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # --- metrics -------------------------------------------------------------------------------------------------

    def _log_completions(self, texts: list[str], rewards: list[float], meta: list[SampleMeta],
                         trajectories: list[dict] | None = None) -> None:
        """One row per completion; in an agent run each also holds its ``trajectory`` (every turn's answer, the
        action sent in screen pixels, the sizes, the reward, and the end)."""
        from accelerate.utils import gather_object

        G = self.num_generations
        rows = [{"step": self.state.global_step, "index": meta[i // G].index, "prompt": meta[i // G].prompt,
                 "reference": meta[i // G].reference, "completion": text, "reward": reward,
                 "blank": meta[i // G].blank}
                for i, (text, reward) in enumerate(zip(texts, rewards))]
        for row, trajectory in zip(rows, trajectories or []):
            row["trajectory"] = trajectory
        rows = gather_object(rows)
        if self.accelerator.is_main_process:
            os.makedirs(self.args.output_dir, exist_ok=True)
            with open(os.path.join(self.args.output_dir, COMPLETIONS), "a", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def _reduced_metrics(self) -> dict[str, float]:
        """Every metric collected since the last log over all ranks: counters summed, ``/max`` and ``/min`` the
        extreme of every value any rank collected, the rest averaged over them. Ranks may hold different names (a
        rank whose rollouts had no reference boxes has no monitors), so the names are gathered first and each rank
        sends a sum, a count and its extremes per name."""
        names = sorted(self.run_state.metrics)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            names = sorted(set().union(*gather_object([names])))
        values = [self.run_state.metrics.get(name, []) for name in names]
        totals = torch.tensor([[float(sum(v)), float(len(v)), max(v, default=-math.inf), min(v, default=math.inf)]
                               for v in values], device=self.accelerator.device)
        if self.accelerator.num_processes > 1 and names:
            sums = self.accelerator.reduce(totals[:, :2].contiguous(), reduction="sum")
            high = self.accelerator.gather(totals[:, 2].contiguous()).view(-1, len(names)).max(dim=0).values
            low = self.accelerator.gather(totals[:, 3].contiguous()).view(-1, len(names)).min(dim=0).values
            totals = torch.cat([sums, high[:, None], low[:, None]], dim=1)
        out = {}
        for name, (total, count, high, low) in zip(names, totals.tolist()):
            if name.endswith(COUNTERS):
                out[name] = round(total, 6)
            elif count and name.endswith("/max"):
                out[name] = round(high, 6)
            elif count and name.endswith("/min"):
                out[name] = round(low, 6)
            elif count:
                out[name] = round(total / count, 6)
        return out

    def _monitor_metrics(self) -> dict[str, float]:
        """The detection, span and click monitors since the last log, from every rank's counts merged (exact
        rates)."""
        run = self.run_state
        tallies = [run.monitors, run.span_monitors, run.click_monitors or ClickMonitorTally()]
        self.run_state.monitors, self.run_state.span_monitors = MonitorTally(), SpanMonitorTally()
        if self.run_state.click_monitors is not None:
            self.run_state.click_monitors = ClickMonitorTally()
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            merged = [MonitorTally(), SpanMonitorTally(), ClickMonitorTally()]
            for parts in gather_object([tallies]):
                for total, part in zip(merged, parts):
                    total.merge(part)
            tallies = merged
        return {f"monitor/{key}": round(value, 6) for tally in tallies for key, value in tally.to_dict().items()
                if value is not None}

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add the step's GRPO metrics: means averaged over ranks, error and parse-failure counts summed."""
        if "loss" in logs and torch.cuda.is_available():
            peak = max(self.run_state.cuda_peak, torch.cuda.max_memory_allocated())
            logs["memory/max_allocated_gib"] = round(peak / 2**30, 3)
        if "loss" in logs and self.run_state.metrics:
            logs.update(self._reduced_metrics())
            logs.update(self._monitor_metrics())
            self.run_state.metrics.clear()
        super().log(logs, *args, **kwargs)
