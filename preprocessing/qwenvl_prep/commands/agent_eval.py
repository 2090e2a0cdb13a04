"""``qwenvl-prep agent-eval``: a trained folder played against an environment class, one JSON row per trajectory, and
a report with bootstrap intervals."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.agent.runner import MAX_TIMEOUT_S
from qwenvl_prep.commands.evaluate import add_bootstrap_flags
from qwenvl_prep.commands.options import count, finite, seed
from qwenvl_prep.pipeline.predict import MIN_TEMPERATURE

MAX_TURNS = 8


def run(args: argparse.Namespace) -> int:
    """Play every task (batches of trajectories, written whole to a resumable output), then report."""
    from qwenvl_prep.pipeline.agent_eval import DEFAULT_PROMPT, AgentTask, dataset_tasks, env_tasks
    from qwenvl_prep.pipeline.eval_report import settings_of
    from qwenvl_prep.plumbing.outputs import Outputs
    from qwenvl_prep.plumbing.resumable import ResumableOutput

    if args.seed is not None and args.temperature == 0:
        raise ValueError("--seed only acts with --temperature > 0: greedy answers do not depend on a seed")
    if (args.tasks is None) == (args.dataset is None):
        raise ValueError("give --tasks N (tasks {\"id\": k} reset with seed k) or --dataset FILE (each record's meta a "
                         "task), one of them")
    if args.dataset is not None and args.prompt is not None:
        raise ValueError("--dataset asks each record's own prompt; give it without --prompt")
    env_kwargs = env_keywords(args.env_kwargs)
    if args.dataset is not None:
        jobs = dataset_tasks(str(args.dataset))
    else:
        prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
        jobs = [AgentTask(task, task["id"], prompt) for task in env_tasks(args.tasks)]
    target = args.env.rsplit(":", 1)[0].strip()
    inputs = [args.model_dir, *([args.dataset] if args.dataset else []), *([args.compare] if args.compare else []),
              *([target] if target.endswith(".py") else [])]
    guard = Outputs(inputs)
    settings = recorded_settings(args, jobs, env_kwargs)
    output = ResumableOutput(args.output, settings, args.batch_size)
    for path in output.outputs():
        guard.check(path, "-o")
    if args.report:
        guard.check(args.report, "--report")
        if args.report.resolve() in {p.resolve() for p in output.outputs()}:
            raise ValueError(f"--report {args.report} is one of the output's own files")
    if args.compare and not args.compare.is_file():
        raise ValueError(f"--compare {args.compare}: not a file (a finished agent-eval output)")
    if finished(output, settings):  # the report of a finished run again (another --compare): nothing is played
        from qwenvl_prep.pipeline.agent_report import read_rows

        rows = read_rows(args.output)
    else:
        rows = play(args, jobs, env_kwargs, output)
    if args.compare:
        from qwenvl_prep.pipeline.agent_report import compare_problem

        problem = compare_problem(settings, settings_of(args.compare))
        if problem:
            raise ValueError(f"--compare {args.compare}: {problem}")
    return report(args, rows)


def play(args: argparse.Namespace, jobs: list[Any], env_kwargs: dict[str, Any], output: Any) -> list[dict]:
    """The trajectories: the environment slots started first (a class that cannot load fails before the model
    loads), then the model, then every batch not yet written."""
    from qwenvl_prep.pipeline.agent_eval import AgentPlayer, VLLMAgentPlayer, model_max_tokens, play_all, start_runners
    from qwenvl_prep.pipeline.predict import FolderModel, Predictor

    policy = FolderModel(args.model_dir).policy  # the frame every screenshot is checked against where it is made
    runners = start_runners(args.env, env_kwargs, policy, min(args.batch_size, len(jobs)), args.isolation,
                            args.step_timeout)
    try:
        if args.backend == "vllm":
            from qwenvl_prep.pipeline.predict_vllm import VLLMPredictor

            predictor = VLLMPredictor(args.model_dir, args.max_new_tokens, args.temperature, args.seed or 0,
                                      images_per_prompt=args.max_turns)
            from transformers import AutoConfig

            max_tokens = args.max_tokens or model_max_tokens(AutoConfig.from_pretrained(args.model_dir))
            player: AgentPlayer = VLLMAgentPlayer(predictor, runners, args.max_turns, max_tokens,
                                                  args.success_reward)
        else:
            predictor = Predictor(args.model_dir, args.max_new_tokens, args.temperature, args.seed or 0)
            max_tokens = args.max_tokens or model_max_tokens(predictor.model.config)
            player = AgentPlayer(predictor, runners, args.max_turns, max_tokens, args.success_reward)
        with output:  # a stopped run continues from its last whole batch of trajectories
            if output.done < len(jobs):
                play_all(player, jobs, args.batch_size, output)
            return output.rows()
    finally:
        for runner in runners:
            runner.shutdown()


def finished(output: Any, settings: dict[str, Any]) -> bool:
    """A finished output of these very settings (no partial one beside it)."""
    from qwenvl_prep.pipeline.eval_report import settings_of

    return output.path.is_file() and not output.partial.exists() and settings_of(output.path) == settings


def report(args: argparse.Namespace, rows: list[dict]) -> int:
    """The metrics with their intervals: a JSON summary on stdout, and the Markdown report when asked."""
    from qwenvl_prep.pipeline.agent_report import agent_report_markdown, agent_result, paired_rows, read_rows
    from qwenvl_prep.plumbing.atomic import atomic_writer

    other = paired_rows(rows, read_rows(args.compare), args.compare) if args.compare else None
    result = agent_result(rows, args.bootstrap, args.bootstrap_seed, other)
    if args.report:
        with atomic_writer(args.report) as f:
            f.write(agent_report_markdown(result, [args.output, *([args.compare] if args.compare else [])]))
    print(json.dumps({key: result[key] for key in ("trajectories", "ends", "agent")}, indent=2))
    return 0


def env_keywords(text: str | None) -> dict[str, Any]:
    """``--env-kwargs``: a JSON object (the environment's constructor's keyword arguments)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--env-kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--env-kwargs must be a JSON object, got {type(value).__name__}")
    return value


def recorded_settings(args: argparse.Namespace, jobs: list[Any], env_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What produced the trajectories: the model folder and its frame, the environment, the tasks (their source,
    count and a digest), the prompt, the settings and the versions. A resumed run must match it key for key."""
    from llamafactory_qwenvl_patch.frame.policy_record import read_policy_record
    from qwenvl_prep.pipeline.agent_eval import tasks_digest
    from qwenvl_prep.pipeline.eval_report import versions

    return {"model_dir": str(Path(args.model_dir).resolve()), "policy": read_policy_record(args.model_dir),
            "env": {"spec": args.env, "kwargs": env_kwargs},
            "tasks": {"source": str(Path(args.dataset).resolve()) if args.dataset else f"--tasks {args.tasks}",
                      "count": len(jobs), "sha256": tasks_digest(jobs)},
            "prompt": "the dataset's own prompts" if args.dataset else jobs[0].prompt,
            "settings": {"backend": args.backend, "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
                         "max_tokens": args.max_tokens, "batch_size": args.batch_size,
                         "temperature": args.temperature, "seed": args.seed or 0, "isolation": args.isolation,
                         "step_timeout": args.step_timeout, "success_reward": args.success_reward},
            "versions": versions()}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    ag = sub.add_parser(
        "agent-eval",
        help="play a trained folder against a GUI environment class, turn by turn in its frame; success rate, steps "
        "to success and invalid actions with intervals",
        description="Play each task to its end: every screenshot resized by the folder's pinned policy, the "
        "conversation so far rendered by its chat template, the answer read as an action and mapped back to that "
        "screenshot's pixels, then sent to the environment (llamafactory_qwenvl_patch.agent; run in worker "
        "processes with a timeout). Writes one JSON row per trajectory (each turn's answer, the action as sent, the "
        "screen's sizes, the reward; how it ended: done, turns, context, template_token, env_error, env_timeout) "
        "and prints the success rate, steps to success and invalid-action rate. docs/agents.md, 'Evaluating an agent'.",
    )
    ag.add_argument("model_dir", type=Path, metavar="FOLDER",
                    help="exported model folder, a full checkpoint, or a LoRA adapter folder of llamafactory-cli "
                    "train (as predict takes them)")
    ag.add_argument("--env", required=True, metavar="SPEC",
                    help="the environment class: module:Class or path/to/env.py:Class (e.g. "
                    "qwenvl_prep.demos.gui_env:ClickThroughEnv)")
    ag.add_argument("--env-kwargs", metavar="JSON", help="its constructor's keyword arguments, a JSON object")
    tasks = ag.add_argument_group("tasks (one of)")
    tasks.add_argument("--tasks", type=count(1), metavar="N",
                       help="N tasks: task k is {\"id\": k}, reset with seed k (the same tasks for every model)")
    tasks.add_argument("--dataset", type=Path, help="a dataset whose records are tasks: each record's meta is given "
                       "to reset (seed: its index), asked under its own prompt and system prompt")
    ag.add_argument("--prompt", help="with --tasks: the text before the first screenshot (default: the action "
                    "format, as docs/agents.md writes it)")
    ag.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.jsonl",
                    help="one JSON row per trajectory, written a batch at a time to OUT.partial: a stopped run "
                    "started again with the same settings continues; the settings go to OUT.settings.json. A "
                    "finished output of the same settings is not played again (its report is written again)")
    ag.add_argument("--report", type=Path, metavar="FILE.md",
                    help="also write a Markdown report: what ran (model, frame, environment, tasks, settings, "
                    "versions), how trajectories ended, each metric and its 95%% bootstrap interval over tasks")
    ag.add_argument("--compare", type=Path, metavar="OUT_B.jsonl",
                    help="a finished agent-eval output of the same tasks (another model): each metric of both and "
                    "the paired difference (this - B) with its interval, from the same resampled tasks")
    add_bootstrap_flags(ag)
    ag.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                    help="hf: transformers generate (default; full and adapter folders); vllm: offline vLLM on a merged "
                    "folder, every screenshot of a conversation in one prompt (the engine's image limit is "
                    "--max-turns), each prompt checked to hold the frame's image tokens")
    ag.add_argument("--max-turns", type=count(1), default=MAX_TURNS,
                    help=f"actions per trajectory before it ends 'turns' (default {MAX_TURNS})")
    ag.add_argument("--max-new-tokens", type=count(1), default=128, help="tokens per answer (default 128)")
    ag.add_argument("--max-tokens", type=count(2), metavar="N",
                    help="a conversation whose next turn (with --max-new-tokens) would pass N tokens ends 'context' "
                    "before its screen is shown (default: the model's max_position_embeddings)")
    ag.add_argument("--batch-size", type=count(1), default=8,
                    help="trajectories played together (one generate per turn, one environment each; default 8)")
    ag.add_argument("--temperature", type=finite("--temperature", True, " (0 = greedy)", least=MIN_TEMPERATURE),
                    default=0.0,
                    help="0 (default): greedy; > 0: sample at this temperature, seeded per batch")
    ag.add_argument("--seed", type=seed, help="seed of the sampling (only with --temperature > 0; default 0)")
    ag.add_argument("--isolation", choices=("process", "inline"), default="process",
                    help="process (default): each environment in a worker process, killed at its timeout; inline: "
                    "in this process, in a thread (pure-Python simulators; a hung call cannot be stopped)")
    ag.add_argument("--step-timeout", type=finite("--step-timeout", False, most=MAX_TIMEOUT_S), default=60.0, metavar="SECONDS",
                    help="seconds each reset, step and close may take (default 60); past it the trajectory ends "
                    "env_timeout")
    ag.add_argument("--success-reward", type=finite("--success-reward", False), default=1.0, metavar="R",
                    help="a trajectory succeeds when its rewards sum to at least R (default 1: the shipped "
                    "simulator's reward for passing every screen)")
    ag.set_defaults(func=run)
