"""``qwenvl-prep demo OUT --task agent``: a multi-turn GUI agent on CPU, against the shipped simulator.

Successful trajectories drawn by the simulator itself (``gui_env.draw_task_screen``: real screen sizes, one control a
screen, one colour per label) are written as multi-turn LF sharegpt records, one screenshot a user turn and the click
action in that screenshot's pixels in each answer (``{"action": "click", "point_2d": [x, y]}``) ->
``qwenvl-prep convert`` (each click into its own screenshot's model frame) -> check -> a small random-weight model ->
``llamafactory-cli train`` (SFT from scratch on the trajectories, then multi-turn GRPO with
``grpo_agent_env: qwenvl_prep.demos.gui_env:ClickThroughEnv`` and the ``env,action_format`` rewards on other tasks: K
screens a task, reward 1 when the last one is passed) -> export -> ``qwenvl-prep agent-eval`` of held-out tasks,
played greedily, by the untrained, the SFT and the trained (SFT + GRPO) model: success rate and steps to success,
with bootstrap intervals.

Why SFT on whole trajectories first: the design's prototype saw rules conditioned on the screen not rise in 60 GRPO
steps from random weights; and a model taught single screens alone answered turn 1 and then wrote broken JSON once
a second screenshot followed its own answer (measured: success 0 on 100 held-out tasks after 1,300 steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from qwenvl_prep.demos import gui
from qwenvl_prep.demos.gui_env import draw_task_screen
from qwenvl_prep.demos.steps import (ONE_THREAD, convert_and_check, export_full, full_training, grpo_stage, losses,
                                    new_run_folder, run_step, sft_stage, small_model, write_jsonl, write_yaml)
from qwenvl_prep.formats.converted import load_jsonl

ENV = "qwenvl_prep.demos.gui_env:ClickThroughEnv"
SCREENS = 2  # K screens a task: success needs every one passed, so a per-screen accuracy p gives about p ** K
CONTROLS = 1  # controls a screen: what the GUI demo's small model learns in its default step count (docs/gui-detection.md)
ENV_KWARGS = {"screens": SCREENS, "controls": CONTROLS}
TASK_PROMPT = 'Press the control each screen names, one per turn. Answer {"action": "click", "point_2d": [x, y]}.'
MAX_TURNS = SCREENS + 1  # one retry
MAX_NEW_TOKENS = 32  # a click action is about 20 tokens
MAX_TOKENS = 1024  # a whole trajectory: K + 1 screenshots of 45-60 tokens at the demo's bounds, the prompt, actions
DEFAULT_FAMILY = gui.DEFAULT_FAMILY
# the GUI demo's 1,300 optimiser steps, each on 8 trajectories of 2 screenshots: held-out success 0.97 after SFT
# (650 steps, the GUI demo's screenshot count: 0.14)
SFT_STEPS = 1300
SFT_STEPS_PER_MINUTE = 160  # measured on 2 CPU cores, ONE_THREAD, no gradient checkpointing (2.7 a second)
DEFAULT_MINUTES = SFT_STEPS / SFT_STEPS_PER_MINUTE
GRPO_STEPS, GRPO_SMOKE_STEPS = 30, 2
GRPO_TASKS = 4  # tasks a GRPO step, G trajectories each
GRPO_GENERATIONS = 4
GRPO_LEARNING_RATE = 1.0e-4
HELD_OUT, HELD_OUT_SMOKE = 100, 8


def trajectory_records(raw: Path, seed: int, count: int) -> list[dict[str, Any]]:
    """``count`` successful trajectories as multi-turn sharegpt records, drawn by the simulator itself
    (``gui_env.draw_task_screen``: the screens a GRPO task shows, for other tasks): the task's prompt and its first
    screenshot with the simulator's text, the click at the named control's centre in that screenshot's pixels, the
    next screenshot with its text, its click, and so on; ``convert`` maps each click through its own screenshot's
    frame. The screenshots are written as JPEG (LF decodes each at every step; ``demos.gui`` measured why)."""
    raw.mkdir(parents=True, exist_ok=True)
    platforms = list(gui.SCREENS)
    records = []
    for i in range(count):
        task = {"id": f"s{seed}-sft-{i}", "screens": SCREENS, "platform": platforms[i % len(platforms)]}
        messages, images = [], []
        for index in range(SCREENS):
            screen = draw_task_screen(task, seed, index, CONTROLS)
            name = f"s{seed}_{i:04d}_{index}.jpg"
            screen.image.save(raw / name, quality=90)
            x1, y1, x2, y2 = screen.box
            text = f"Screen {index + 1} of {SCREENS}: press {screen.label}."
            messages += [{"role": "user", "content": (TASK_PROMPT if index == 0 else "") + "<image>" + text},
                         {"role": "assistant", "content": json.dumps({"action": "click",
                                                                      "point_2d": [(x1 + x2) / 2, (y1 + y2) / 2]})}]
            images.append(name)
        records.append({"messages": messages, "images": images})
    return records


def task_records(prefix: str, count: int) -> list[dict[str, Any]]:
    """``count`` tasks as records (the prompt, a reference answer LF's loader wants, ``meta`` for ``reset``), the
    platforms in turn."""
    platforms = list(gui.SCREENS)
    return [{"messages": [{"role": "user", "content": TASK_PROMPT},
                          {"role": "assistant", "content": '{"action": "done"}'}],
             "meta": {"id": f"{prefix}{i}", "screens": SCREENS, "platform": platforms[i % len(platforms)]}}
            for i in range(count)]


def register_tasks(data: Path, name: str, records: list[dict[str, Any]]) -> Path:
    """Write the tasks beside the converted datasets and register them in ``dataset_info.json`` (only the messages
    column: an agent's screenshots come from the environment, its ``meta`` is read by the agent trainer)."""
    path = write_jsonl(data / f"{name}.jsonl", records)
    info_path = data / "dataset_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info[name] = {"file_name": path.name, "formatting": "sharegpt", "columns": {"messages": "messages"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant"}}
    info_path.write_text(json.dumps(info, indent=2))
    return path


def agent_stage(common: dict[str, Any], start: Path, output: Path, steps: int) -> dict[str, Any]:
    """Multi-turn GRPO from the SFT model against the simulator: GRPO_TASKS tasks a step, G trajectories each at
    temperature 1, the environments inline (a pure-Python simulator: no worker processes to start on 2 cores)."""
    return {**grpo_stage(common, start, output, "agent_tasks", "env,action_format", steps, MAX_NEW_TOKENS),
            "reward_weights": "1.0,0.1", "grpo_num_generations": GRPO_GENERATIONS,
            "per_device_train_batch_size": GRPO_TASKS, "learning_rate": GRPO_LEARNING_RATE, "cutoff_len": MAX_TOKENS,
            "grpo_agent_env": ENV, "grpo_agent_env_kwargs": json.dumps(ENV_KWARGS), "grpo_agent_max_turns": MAX_TURNS,
            "grpo_agent_max_tokens": MAX_TOKENS, "grpo_agent_isolation": "inline"}


def agent_eval(name: str, model_dir: Path, tasks: Path, out: Path, logs: Path) -> dict[str, Any]:
    """``qwenvl-prep agent-eval`` of the held-out tasks, greedy: its JSON summary (success rate, steps to success,
    invalid actions, each with its interval) and the Markdown report beside the rows."""
    rows, report, printed = (out / f"agent-eval-{name}{suffix}" for suffix in (".jsonl", ".md", ".json"))
    run_step(f"agent-eval-{name}", ["qwenvl-prep", "agent-eval", str(model_dir), "--env", ENV, "--env-kwargs",
                                    json.dumps(ENV_KWARGS), "--dataset", str(tasks), "-o", str(rows), "--report",
                                    str(report), "--max-turns", str(MAX_TURNS), "--max-new-tokens",
                                    str(MAX_NEW_TOKENS), "--batch-size", "16", "--isolation", "inline"], logs, ONE_THREAD, printed)
    result = json.loads(printed.read_text())
    agent = result["agent"]
    return {"success_rate": agent["success_rate"], "mean_steps_to_success": agent["mean_steps_to_success"],
            "invalid_action_rate": agent["invalid_action_rate"], "trajectories": result["trajectories"],
            "ends": result["ends"], "rows": str(rows), "report": str(report)}


def run_agent_demo(out: Path, steps: int, family: str = DEFAULT_FAMILY, seed: int = 0) -> dict[str, Any]:
    """The agent demo (see the module's docstring) with ``steps`` SFT steps; under 50 is a smoke run (fewer
    held-out tasks and GRPO steps). ``seed`` draws the screens, the tasks' names and the initial model."""
    out, logs = new_run_folder(out)
    data, raw = out / "data", out / "raw"
    learning = steps >= 50
    trajectories = min(gui.MAX_TRAIN // SCREENS, max(32, steps * gui.SFT_BATCH))
    (raw / "train.json").write_text(json.dumps(trajectory_records(raw, seed, trajectories), indent=1))
    policy = ResizePolicy(gui.MIN_PIXELS, gui.MAX_PIXELS, FAMILIES[family].factor)
    model = small_model(out / "model", family, policy, logs, seed)
    common = full_training(family, data, "agent_train", policy)
    sft_yaml = write_yaml(out / "sft.yaml", {**sft_stage(common, model, out / "sft", steps, gui.SFT_BATCH),
                                             "dataloader_num_workers": 1, "dataloader_persistent_workers": True,
                                             "disable_gradient_checkpointing": True})
    convert_and_check({"train": raw / "train.json"}, data, "agent", sft_yaml, ["--input-coords", "abs"], logs)
    grpo_steps = GRPO_STEPS if learning else GRPO_SMOKE_STEPS
    register_tasks(data, "agent_tasks", task_records(f"s{seed}-train-", grpo_steps * GRPO_TASKS))
    held_out = register_tasks(data, "agent_held_out",
                              task_records(f"s{seed}-held-out-", HELD_OUT if learning else HELD_OUT_SMOKE))
    evaluated = {"untrained": agent_eval("untrained", model, held_out, out, logs)}
    run_step("train-sft", ["llamafactory-cli", "train", str(sft_yaml)], logs, ONE_THREAD)
    evaluated["sft"] = agent_eval("sft", out / "sft", held_out, out, logs)
    grpo_yaml = write_yaml(out / "grpo.yaml", agent_stage(common, out / "sft", out / "grpo", grpo_steps))
    run_step("train-grpo", ["llamafactory-cli", "train", str(grpo_yaml)], logs, ONE_THREAD)
    export_full(out / "grpo", out / "exported", family, policy, sft_yaml, logs)
    evaluated["trained"] = agent_eval("trained", out / "exported", held_out, out, logs)
    grpo_log = load_jsonl(out / "grpo" / "trainer_log.jsonl")
    env_reward = [row.get("rewards/env/mean") for row in grpo_log if "rewards/env/mean" in row]
    sft_loss = losses(out / "sft")
    return {"task": "agent", "family": family, "seed": seed, "sft_steps": steps, "grpo_steps": grpo_steps,
            "screens_per_task": SCREENS, "controls": CONTROLS, "max_turns": MAX_TURNS,
            "train_trajectories": trajectories, "grpo_tasks": grpo_steps * GRPO_TASKS,
            "held_out_tasks": HELD_OUT if learning else HELD_OUT_SMOKE, "held_out": evaluated,
            "headline": "held_out.trained (SFT + GRPO) against held_out.untrained (the random-weight model); "
                        "held_out.sft is the SFT model before GRPO",
            "sft_loss_first_last": [sft_loss[0], sft_loss[-1]] if sft_loss else None,
            "grpo_env_reward_first_last": [env_reward[0], env_reward[-1]] if env_reward else None,
            "grpo_env_reward": env_reward, "data": str(data), "exported": str(out / "exported"),
            "logs": str(logs)}


def format_agent_summary(summary: dict[str, Any]) -> str:
    """The held-out table a person reads at the end of the demo (the JSON summary goes to stdout)."""
    lines = [f"held-out tasks: {summary['held_out_tasks']} ({summary['family']}, {summary['sft_steps']} SFT steps on "
             f"two-screen trajectories, {summary['grpo_steps']} GRPO steps; {summary['screens_per_task']} screens a task, "
             f"{summary['max_turns']} actions at most), played greedily",
             f"{'':20}{'success rate':>14}{'steps to success':>18}{'invalid actions':>17}"]
    for key, name in (("untrained", "untrained"), ("sft", "SFT"), ("trained", "SFT + GRPO")):
        result = summary["held_out"][key]
        steps = result["mean_steps_to_success"]
        steps_text = "-" if steps is None else f"{steps:.2f}"
        lines.append(f"{name:20}{result['success_rate']:>14.2f}{steps_text:>18}{result['invalid_action_rate']:>17.2f}")
    lines.append(f"reports with 95% intervals: {Path(summary['held_out']['trained']['report']).parent}/agent-eval-*.md")
    return "\n".join(lines)
