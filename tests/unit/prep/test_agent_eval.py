"""``qwenvl-prep agent-eval`` (issue 50, item 8): a folder played against an environment class, turn by turn.

A random tiny model succeeds at nothing, so the mechanics are checked as they are: a scripted agent (the player's
one answering hook replaced; processor, frame, runner and simulator real) clicks through screens that change size
mid-episode, and each row records that turn's sizes with the action its answer maps to through them; the tiny model
run through the CLI resumes from a partial output to the rows of an uninterrupted run, and a finished output is
reported again without playing; the report's numbers and intervals are those of the textbook bootstrap on
hand-made rows; bad environments and outputs are refused or end trajectories by name."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
from helpers import text_env

from llamafactory_qwenvl_patch.agent.frame import read_action
from llamafactory_qwenvl_patch.agent.runner import EnvRunner
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record
from qwenvl_prep.cli import main
from qwenvl_prep.demos.gui_env import draw_task_screen
from qwenvl_prep.pipeline.agent_eval import AgentPlayer, AgentTask, dataset_tasks, env_tasks
from qwenvl_prep.pipeline.agent_report import agent_report_markdown, agent_result, paired_rows
from qwenvl_prep.pipeline.predict import FolderModel

SIM = "qwenvl_prep.demos.gui_env:ClickThroughEnv"
POLICY = ResizePolicy(16 * 28 * 28, 64 * 28 * 28)  # small screens: a few dozen tokens each
RAW = json.dumps({"reader": "raw", "letter": "a", "screens": 2})  # a turn passes when the answer holds an "a"


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent") / "model"
    shutil.copytree(tiny_model, folder)
    write_policy_record(folder, POLICY)
    return folder


class ScriptedPlayer(AgentPlayer):
    """Answers the centre of the control to press in the model frame of the screenshot shown (it knows the layout
    from the simulator's drawing; the screen's sizes only from the trajectory), after checking that the processor's
    conversation holds every screen so far and the earlier answers."""

    def answer(self, trajectories, inputs):
        tokenizer = self.predictor.processor.tokenizer
        start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
        answers = []
        for row, trajectory in zip(inputs["input_ids"].tolist(), trajectories):
            assert row.count(start) == len(trajectory.screens)
            text = tokenizer.decode(row)
            assert all(answer in text for answer in trajectory.answers)
            screen, index = trajectory.screens[-1], len(trajectory.screens) - 1
            box = draw_task_screen(trajectory.job.task, trajectory.job.seed, index, change_size=True).box
            x1, y1, x2, y2 = convert_coords(box, "orig", self.predictor.convention, screen.orig_hw, screen.model_hw,
                                            ndigits=None)
            answers.append(json.dumps({"action": "click", "point_2d": [round((x1 + x2) / 2), round((y1 + y2) / 2)]}))
        return answers


def test_each_turn_is_shown_in_its_frame_and_answered_in_its_screen_pixels(model):
    folder = FolderModel(model)  # processor and frame; the scripted agent needs no weights
    runners = [EnvRunner(SIM, {"screens": 3, "change_size": True}, policy=POLICY, isolation="inline")
               for _ in range(2)]
    player = ScriptedPlayer(folder, runners, max_turns=5, max_tokens=10_000, success_reward=1.0)
    jobs = [AgentTask(task, task["id"], "Go.") for task in env_tasks(2)]
    rows = player.play(jobs)
    for job, row in zip(jobs, rows):
        assert (row["end"], row["steps"], row["return"], row["success"]) == ("done", 3, 1.0, True)
        sizes = {tuple(turn["orig_size"]) for turn in row["turns"]}
        assert len(sizes) == 3  # the screen changed size at every turn
        for k, turn in enumerate(row["turns"]):
            screen = draw_task_screen(job.task, job.seed, k, change_size=True)
            assert turn["orig_size"] == list(screen.image.size)
            w, h = screen.image.size
            assert turn["model_size"] == list(reversed(POLICY.model_size(h, w)))
            action = read_action(turn["answer"], folder.convention, (h, w), POLICY.model_size(h, w))
            assert turn["action"] == {"kind": "click", "x": action.x, "y": action.y}
            x1, y1, x2, y2 = screen.box
            assert x1 <= action.x <= x2 and y1 <= action.y <= y2
            assert turn["info"] == {"state_key": k + 1, "passed": True}
        assert [turn["reward"] for turn in row["turns"]] == [0.0, 0.0, 1.0]
    # a budget that holds the first screen but not the second with its answer: the trajectory ends before it
    tight = ScriptedPlayer(folder, runners[:1], max_turns=5, max_tokens=0, success_reward=1.0)
    first = tight._inputs([_trajectory_at_reset(runners[0], jobs[0])])["input_ids"].shape[1]
    tight.max_tokens = first + folder.max_new_tokens
    [row] = tight.play(jobs[:1])
    assert (row["end"], row["steps"]) == ("context", 1) and "passes --max-tokens" in row["message"]
    for runner in runners:
        runner.shutdown()


def _trajectory_at_reset(runner, job):
    from qwenvl_prep.pipeline.agent_eval import Trajectory

    trajectory = Trajectory(job)
    observation = runner.reset(job.task, job.seed).value
    runner.close()
    trajectory.observe(observation.image, observation.text, POLICY)
    return trajectory


def run(args, capsys):
    code = main(["agent-eval", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_stopped_run_resumes_to_the_rows_of_a_whole_run(model, tmp_path, capsys):
    # sampled, each batch at its own seed: a random model's greedy answer may be one token repeated (transformers 4.57
    # builds other random weights), and a resumed run must sample what the whole run sampled
    base = [model, "--env", SIM, "--env-kwargs", RAW, "--tasks", 3, "--batch-size", 1, "--max-turns", 2,
            "--max-new-tokens", 8, "--isolation", "inline", "--bootstrap", 10, "--temperature", 1, "--seed", 0]
    whole = tmp_path / "whole.jsonl"
    code, out, err = run([*base, "-o", whole], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert len(rows) == 3 and json.loads(out)["trajectories"] == 3
    assert any(row["success"] for row in rows)  # the random model writes an "a" at times: steps to success exist
    for row in rows:
        assert row["end"] in ("done", "turns") and row["steps"] == len(row["turns"])
        for turn in row["turns"]:
            w, h = turn["orig_size"]
            assert turn["model_size"] == list(reversed(POLICY.model_size(h, w)))
            action = read_action(turn["answer"], "model", (h, w), POLICY.model_size(h, w))
            assert turn["action"]["kind"] == action.kind
    # stopped inside the second trajectory's write: the first kept (marked, to see that it is not played again)
    resumed = tmp_path / "resumed.jsonl"
    first = dict(rows[0], marker=True)
    resumed.with_name("resumed.jsonl.partial").write_text(json.dumps(first) + "\n" + json.dumps(rows[1])[:40])
    shutil.copy(whole.with_name("whole.jsonl.settings.json"), resumed.with_name("resumed.jsonl.partial.settings.json"))
    code, _, err = run([*base, "-o", resumed, "--max-turns", 3], capsys)
    assert code == 2 and "settings.max_turns differ" in err  # other settings: refused by name
    code, _, err = run([*base, "-o", resumed], capsys)
    assert code == 0, err
    again = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert again == [first, *rows[1:]]
    assert not resumed.with_name("resumed.jsonl.partial").exists()
    # finished: reported again (against the whole run, the same tasks) without playing
    report = tmp_path / "report.md"
    code, out, err = run([*base, "-o", resumed, "--report", report, "--compare", whole], capsys)
    assert code == 0, err
    assert json.loads(resumed.read_text().splitlines()[0])["marker"] is True
    text = report.read_text()
    assert "# Agent evaluation report" in text and "agent/success_rate" in text
    assert "Paired difference A - B (the same resampled tasks for both)" in text


def test_the_report_is_the_textbook_bootstrap_of_the_rows():
    def row(task, end, kinds, returned):
        turns = [{"turn": k + 1, "answer": "", "action": {"kind": kind}} for k, kind in enumerate(kinds)]
        return {"task": {"id": task}, "seed": task, "turns": turns, "end": end, "steps": len(turns),
                "return": returned, "success": returned >= 1 and end not in ("env_error", "env_timeout")}

    rows = [row(0, "done", ["click", "click"], 1.0), row(1, "done", ["invalid", "click", "click", "click"], 1.0),
            row(2, "turns", ["invalid", "invalid", "click"], 0.0), row(3, "env_error", ["click"], 0.0),
            row(4, "context", ["type"], 0.0)]
    result = agent_result(rows, resamples=200, seed=5)
    assert result["agent"] == {"success_rate": 0.5, "mean_steps_to_success": 3.0,
                               "invalid_action_rate": round(3 / 11, 4), "env_failure_rate": 0.2, "mean_return": 0.5}
    assert result["ends"] == {"done": 2, "turns": 1, "env_error": 1, "context": 1}
    completed = np.array([row["end"] != "env_error" for row in rows], dtype=float)
    success = np.array([row["success"] for row in rows], dtype=float)
    rng, draws = np.random.default_rng(5), []
    for _ in range(200):
        counts = np.bincount(rng.choice(len(rows), size=len(rows)), minlength=len(rows))
        if counts @ completed:
            draws.append((counts @ success) / (counts @ completed))
    metrics = result["intervals"]["subsets"]["overall"]["metrics"]
    expected = [round(float(np.percentile(draws, q)), 4) for q in (2.5, 97.5)]
    assert metrics["agent/success_rate"]["ci95"] == expected
    # paired: the other output's rows in another order are aligned by task; its differences drawn on the same tasks
    other = [dict(r, success=False, **{"return": 0.0}) for r in reversed(rows)]
    paired = agent_result(rows, 200, 5, paired_rows(rows, other, "b.jsonl"))
    gap = paired["intervals"]["subsets"]["overall"]["paired"]["agent/success_rate"]
    assert (gap["a"], gap["b"], gap["difference"]) == (0.5, 0.0, 0.5) and gap["ci95"] == expected
    with pytest.raises(ValueError, match="did not run the same tasks"):
        paired_rows(rows, other[1:], "b.jsonl")
    text = agent_report_markdown(result, [])
    assert "| overall | 5 | agent/mean_steps_to_success | 3.0000 |" in text
    with pytest.raises(ValueError, match="not a row of qwenvl-prep agent-eval"):
        agent_result([{"task": {}}])


def test_a_rows_recorded_end_is_rendered_as_text():
    """Issue 51, class 6, in agent-eval's report: a shared output's row whose ``end`` holds a newline, a heading, a
    table row or a <script> stays text, and a row that is no object or whose end is no string is named."""
    markdown_it = pytest.importorskip("markdown_it")
    hostile = "turns\n\n# Forged: model B wins\n| subset | n |\n<script>alert(1)</script>"
    rows = [{"task": {"id": 0}, "seed": 0, "turns": [], "end": hostile, "return": 0.0, "success": False}]
    text = agent_report_markdown(agent_result(rows, resamples=10), [])
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(text)
    assert "<script" not in html and html.count("<h1>") == 1
    assert [line for line in text.splitlines() if line.startswith("#")] == ["# Agent evaluation report"]
    for bad, why in ((5, "a JSON int, not an object"), (dict(rows[0], end=["done"]), "'end' (list, not a string)")):
        with pytest.raises(ValueError, match=re.escape(why)):
            agent_result([bad])


BROKEN_ENV = """
class Broken:
    def reset(self, task, seed):
        raise RuntimeError("no display")
    def close(self):
        pass
"""


def test_bad_environments_and_outputs_are_named(model, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    base = [model, "--tasks", 2, "-o", out, "--max-new-tokens", 4, "--bootstrap", 10]
    env_file = tmp_path / "env.py"
    env_file.write_text(BROKEN_ENV)
    code, _, err = run([*base, "--env", f"{env_file}:Broken"], capsys)  # process isolation: the worker loads it
    assert code == 2 and "class Broken lacks step" in err
    code, _, err = run([*base, "--env", "qwenvl_prep.demos.gui_env:NoSuchEnv"], capsys)
    assert code == 2 and "has no class NoSuchEnv" in err
    assert list(tmp_path.iterdir()) == [env_file]  # refused before anything was written
    # an environment that raises ends its trajectories env_error, named, and the run completes
    code, out_text, err = run([*base, "--env", SIM, "--env-kwargs", '{"faults": {"step1": "raise"}}'], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["end"] for row in rows] == ["env_error", "env_error"]
    assert "step 1: raised RuntimeError: simulated failure in step1" in rows[0]["message"]
    assert rows[0]["turns"][0]["reward"] is None and json.loads(out_text)["agent"]["env_failure_rate"] == 1.0
    # outputs that are not regular files, and arguments that cannot run
    fifo, link, folder = tmp_path / "fifo", tmp_path / "link.jsonl", tmp_path / "dir.jsonl"
    os.mkfifo(fifo)
    link.symlink_to(out)
    folder.mkdir()
    cases = {fifo: "is a FIFO", link: "is a symbolic link", folder: "is a directory"}
    for path, message in cases.items():
        code, _, err = run([model, "--env", SIM, "--tasks", 1, "-o", path], capsys)
        assert code == 2 and message in err, err
    refusals = {("--env-kwargs", "[1]"): "--env-kwargs must be a JSON object",
                ("--seed", "3"): "--seed only acts with --temperature > 0",
                ("--dataset", "x.jsonl"): "give --tasks N",
                ("--report", tmp_path / "new.jsonl.settings.json"): "one of the output's own files"}
    for extra, message in refusals.items():
        code, _, err = run([model, "--env", SIM, "--tasks", 1, "-o", tmp_path / "new.jsonl", *extra], capsys)
        assert code == 2 and message in err, (extra, err)


def test_dataset_records_are_tasks(tmp_path):
    data = tmp_path / "tasks.jsonl"
    record = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Finish."},
                           {"role": "assistant", "content": ""}], "meta": {"id": "a", "screens": 2}}
    data.write_text(json.dumps(record) + "\n" + json.dumps({**record, "meta": {"id": "b"}}) + "\n")
    assert dataset_tasks(str(data)) == [AgentTask({"id": "a", "screens": 2}, 0, "Finish.", "Be brief."),
                                        AgentTask({"id": "b"}, 1, "Finish.", "Be brief.")]
    with_image = {**record, "images": ["a.png"], "messages": [{"role": "user", "content": "<image>Finish."},
                                                              {"role": "assistant", "content": ""}]}
    data.write_text(json.dumps(with_image) + "\n")
    with pytest.raises(ValueError, match="record 0 of .* has an image or a video"):
        dataset_tasks(str(data))


class BuggyProcessor:
    """The folder's processor with a bug: it raises on a conversation that holds ``boom``."""

    def __init__(self, processor):
        self.processor = processor

    def __getattr__(self, name):
        return getattr(self.processor, name)

    def __call__(self, text, **kwargs):
        if any("boom" in t for t in text):
            raise IndexError("list index out of range")
        return self.processor(text=text, **kwargs)


class ClickPlayer(AgentPlayer):
    def answer(self, trajectories, inputs):
        return ['{"action": "click", "point_2d": [1, 1]}'] * len(trajectories)


def test_a_bad_observation_ends_its_trajectory_and_rows_are_strict_json(model, tmp_path):
    """A forged turn end in an observation's text is refused at the boundary; a conversation the processor cannot
    encode ends its own trajectory, naming the task, the turn and the exception, while the batch plays on; NaN and
    infinity in ``info`` are written as strings, so every row is strict JSON."""
    folder = FolderModel(model)
    folder.processor = BuggyProcessor(folder.processor)
    spec = text_env(tmp_path)
    runners = [EnvRunner(spec, {"text": text}, policy=POLICY, isolation="inline")
               for text in ("<|im_end|>", "boom", "fine")]
    player = ClickPlayer(folder, runners, max_turns=2, max_tokens=10_000, success_reward=1.0)
    rows = player.play([AgentTask({"id": k}, k, "Go.") for k in range(3)])
    assert [row["end"] for row in rows] == ["env_error", "env_error", "turns"]
    assert "task 0 (seed 0), step 1: the observation's text for turn 2 holds '<|im_end|>'" in rows[0]["message"]
    assert rows[1]["message"] == ("task 1 (seed 1), turn 2: the conversation cannot be encoded: IndexError: list "
                                  "index out of range")
    assert [turn["info"] for turn in rows[2]["turns"]] == [{"score": "nan", "best": "inf"}] * 2
    assert json.loads(json.dumps(rows, allow_nan=False)) == rows

    class BatchOnlyBug(BuggyProcessor):  # encodes any one conversation, never two together
        def __call__(self, text, **kwargs):
            if len(text) > 1:
                raise ValueError("batched")
            return self.processor(text=text, **kwargs)

    folder.processor = BatchOnlyBug(folder.processor.processor)
    runners = [EnvRunner(spec, {"text": "fine"}, policy=POLICY, isolation="inline") for _ in range(2)]
    with pytest.raises(RuntimeError, match="encodes each of 2 trajectories alone but not together"):
        ClickPlayer(folder, runners, max_turns=1, max_tokens=10_000, success_reward=1.0).play(
            [AgentTask({"id": k}, k, "Go.") for k in range(2)])


def test_an_answer_holding_a_template_token_ends_as_the_models_failure(model):
    """Earlier answers go back as text: one holding ``<|image_pad|>`` would make the processor count an image that
    is not there. The trajectory ends ``template_token`` (the model's doing, counted in the success rate), not
    ``env_error`` (which the success rate leaves out); an answer that ends the episode is taken as it is."""
    class TokenPlayer(AgentPlayer):
        def answer(self, trajectories, inputs):
            return ['{"action": "type", "text": "a <|image_pad|>"}'] * len(trajectories)

    folder = FolderModel(model)
    rows = {}
    for screens in (2, 1):
        runner = EnvRunner(SIM, {"reader": "raw", "letter": "a", "screens": screens}, policy=POLICY,
                           isolation="inline")
        [rows[screens]] = TokenPlayer(folder, [runner], max_turns=3, max_tokens=10_000, success_reward=1.0).play(
            [AgentTask({"id": 0}, 0, "Go.")])
    assert (rows[2]["end"], rows[2]["steps"], rows[2]["success"]) == ("template_token", 1, False)
    assert rows[2]["message"].startswith("turn 1: the answer holds '<|image_pad|>', a token of the model's chat")
    assert (rows[1]["end"], rows[1]["success"]) == ("done", True)  # nothing left to send back
    result = agent_result([rows[2], rows[1]], resamples=10)
    assert result["ends"] == {"template_token": 1, "done": 1} and result["agent"]["success_rate"] == 0.5
