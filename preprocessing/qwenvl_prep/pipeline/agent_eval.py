"""``qwenvl-prep agent-eval``: a trained folder played against an environment class, turn by turn, in its pinned frame.

The model is ``predict``'s (``Predictor``: a full folder or a LoRA adapter merged in memory, its recorded frame, its
chat template, greedy or seeded sampling). Each turn of each live trajectory: the screenshot becomes the model input
(``agent.frame.model_screen``, the policy every training image goes through), the whole conversation so far is
rendered by the folder's chat template (the task prompt, the first screenshot and the reset's text; then each earlier
answer as the model wrote it and each later screenshot with its text), the model answers, the answer is read by the
one action parser and mapped through that turn's screenshot sizes (``agent.frame.read_action``) and sent to the
environment (``agent.runner.EnvRunner``: process-isolated and timed). Earlier answers are given back as text, as a
chat server would: evaluation asks the model as it will be asked in use; training's token-exact rows are the GRPO
stage's.

A batch of trajectories generates together (left-padded) and is written as one whole batch of rows, so a stopped run
resumes at a trajectory boundary and, sampling being seeded per batch, writes what the whole run would have.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from llamafactory_qwenvl_patch.agent.checks import json_value
from llamafactory_qwenvl_patch.agent.frame import Screen, ScreenshotError, model_screen, read_action
from llamafactory_qwenvl_patch.agent.runner import (
    ENV_ERROR,
    EnvRunner,
    close_all,
    describe_task,
    reset_all,
    start_all,
    step_all,
)
from llamafactory_qwenvl_patch.agent.types import Action
from llamafactory_qwenvl_patch.frame.families import structure_token_in

DONE, TURNS, CONTEXT = "done", "turns", "context"  # with the runner's env_error and env_timeout: how a trajectory ends
TEMPLATE_TOKEN = "template_token"  # the model wrote a token of the chat template: its history cannot be sent back
DEFAULT_PROMPT = ('You operate the app on the screen. Answer with one action as JSON: {"action": "click", '
                  '"point_2d": [x, y]}, {"action": "type", "text": "..."}, {"action": "scroll", "point_2d": [x, y], '
                  '"direction": "down"}, {"action": "key", "key": "enter"} or {"action": "done"}.')


@dataclass(frozen=True)
class AgentTask:
    """One trajectory to play: the task given to ``reset``, its seed, and the prompt (and system prompt) it is
    asked under."""

    task: dict[str, Any]
    seed: int
    prompt: str
    system: str | None = None


@dataclass
class Trajectory:
    """A trajectory in play: its screens (model inputs with their sizes) and texts, the model's answers, the turns'
    records, and how it ended (None while live)."""

    job: AgentTask
    screens: list[Screen] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    end: str | None = None
    message: str = ""
    closed: str = ""

    def observe(self, image: Any, text: str, policy: Any) -> None:
        self.screens.append(model_screen(image, policy))
        self.texts.append(text)

    def row(self, success_reward: float) -> dict[str, Any]:
        returned = float(sum(turn["reward"] or 0.0 for turn in self.turns))
        row = {"task": self.job.task, "seed": self.job.seed, "turns": self.turns, "end": self.end,
               "steps": len(self.turns), "return": returned,
               "success": self.end not in ("env_error", "env_timeout") and returned >= success_reward}
        if self.message:
            row["message"] = self.message
        if self.closed:
            row["close"] = self.closed
        return row


def env_tasks(count: int) -> list[dict[str, Any]]:
    """``--tasks N``: task ``k`` is ``{"id": k}``, reset with seed ``k``: the same N tasks for every model, so that
    two runs pair up task by task."""
    return [{"id": k} for k in range(count)]


def dataset_tasks(dataset: str) -> list[AgentTask]:
    """``--dataset D``: each record a task, its ``meta`` given to ``reset`` with the record's index as seed, asked
    under its own prompt and system prompt (as a GRPO agent run asks it). ValueError naming the first record that
    cannot be one: unreadable, with an image or a video (a task's screenshots come from the environment), or a
    ``meta`` that is not an object."""
    from qwenvl_prep.formats.converted import iter_samples, resolve_dataset

    ref = resolve_dataset(dataset)
    tasks = []
    for sample in iter_samples(ref):
        where = f"record {sample.index} of {ref.path}"
        if sample.error:
            raise ValueError(f"{where} cannot be a task: {sample.error}")
        if sample.images or sample.videos:
            raise ValueError(f"{where} has an image or a video: an agent's screenshots come from the environment, "
                             "so a task record holds a prompt and its meta only")
        meta = {} if sample.meta is None else sample.meta
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: its meta is a {type(meta).__name__}; a task is a JSON object")
        tasks.append(AgentTask(meta, sample.index, sample.prompt.strip(), sample.system or None))
    if not tasks:
        raise ValueError(f"{ref.path} holds no records")
    return tasks


def action_record(action: Action) -> dict[str, Any]:
    """The action as sent (screen pixels), without the raw text the turn already holds."""
    return {key: value for key, value in (("kind", action.kind), ("x", action.x), ("y", action.y),
                                          ("text", action.text), ("direction", action.direction),
                                          ("key", action.key), ("reason", action.reason)) if value is not None}


class ResizedAgain(RuntimeError):
    """The processor encoded a screenshot in another frame than the model's policy: the folder's processor and
    policy disagree, whatever the environment sent."""


class AgentPlayer:
    """Plays batches of tasks: ``predictor`` (``Predictor``) answers, ``runners`` (one ``EnvRunner`` per trajectory
    of a batch) step the environments."""

    def __init__(self, predictor: Any, runners: Sequence[EnvRunner], max_turns: int, max_tokens: int,
                 success_reward: float) -> None:
        self.predictor, self.runners = predictor, list(runners)
        self.max_turns, self.max_tokens, self.success_reward = max_turns, max_tokens, success_reward

    def play(self, jobs: Sequence[AgentTask]) -> list[dict[str, Any]]:
        """One batch of trajectories, played to their ends; their rows in the order of ``jobs``."""
        runners = self.runners[:len(jobs)]
        trajectories = [Trajectory(job) for job in jobs]
        policy = self.predictor.policy
        for trajectory, outcome in zip(trajectories, reset_all(runners, [j.task for j in jobs],
                                                               [j.seed for j in jobs])):
            self._take(trajectory, outcome, policy, reset=True)
        for turn in range(1, self.max_turns + 1):
            live = [i for i, t in enumerate(trajectories) if t.end is None]
            if not live:
                break
            live, answers = self._answers(trajectories, live)
            actions = []
            for i, answer in zip(live, answers):
                trajectory = trajectories[i]
                screen = trajectory.screens[-1]
                action = read_action(answer, self.predictor.convention, screen.orig_hw, screen.model_hw)
                trajectory.answers.append(answer)
                trajectory.turns.append({"turn": turn, "answer": answer, "action": action_record(action),
                                         "orig_size": [screen.orig_hw[1], screen.orig_hw[0]],
                                         "model_size": [screen.model_hw[1], screen.model_hw[0]],
                                         "reward": None, "done": False})
                actions.append(action)
            for i, outcome in zip(live, step_all([runners[i] for i in live], actions)):
                self._take(trajectories[i], outcome, policy, last=turn == self.max_turns)
        for trajectory, outcome in zip(trajectories, close_all(runners)):
            if not outcome.ok:
                trajectory.closed = outcome.message
        return [trajectory.row(self.success_reward) for trajectory in trajectories]

    def _take(self, trajectory: Trajectory, outcome: Any, policy: Any, reset: bool = False, last: bool = False
              ) -> None:
        """A reset's or step's outcome: the next screen, or the trajectory's end."""
        if not outcome.ok:
            trajectory.end, trajectory.message = outcome.status, outcome.message
            return
        observation = outcome.value if reset else outcome.value.observation
        if not reset:
            step = outcome.value
            trajectory.turns[-1].update(reward=float(step.reward), done=bool(step.done), info=json_value(step.info))
            if step.done:
                trajectory.end = DONE
                return
            if last:
                trajectory.end = TURNS
                return
            token = structure_token_in(trajectory.answers[-1])
            if token is not None:  # the model's own doing: a failure of the model, not of the environment
                trajectory.end = TEMPLATE_TOKEN
                trajectory.message = (f"turn {len(trajectory.answers)}: the answer holds {token!r}, a token of the "
                                      "model's chat template: sent back as the conversation's history it would be "
                                      "read as that token, so the conversation cannot go on")
                return
        try:
            trajectory.observe(observation.image, observation.text, policy)
        except ScreenshotError as exc:  # the runner checks screenshots already; this is the main process's own check
            trajectory.end, trajectory.message = ENV_ERROR, f"the screenshot cannot be shown: {exc}"

    def _messages(self, trajectory: Trajectory) -> list[dict[str, Any]]:
        """The conversation so far in the chat template's message form, ending with the user's latest screen."""
        job = trajectory.job
        messages: list[dict[str, Any]] = []
        if job.system is not None:
            messages.append({"role": "system", "content": [{"type": "text", "text": job.system}]})
        for k, text in enumerate(trajectory.texts):
            if k:
                messages.append({"role": "assistant", "content": [{"type": "text", "text": trajectory.answers[k - 1]}]})
            content = [{"type": "text", "text": job.prompt}] if k == 0 and job.prompt else []
            content.append({"type": "image"})
            if text:
                content.append({"type": "text", "text": text})
            messages.append({"role": "user", "content": content})
        return messages

    def _inputs(self, trajectories: Sequence[Trajectory]) -> Any:
        """The processor's batch of these conversations, every screenshot checked to be encoded in its frame."""
        processor = self.predictor.processor
        texts = [processor.apply_chat_template(self._messages(t), add_generation_prompt=True) for t in trajectories]
        images = [screen.image for t in trajectories for screen in t.screens]
        inputs = processor(text=texts, images=images, return_tensors="pt", padding=True)
        sizes = [screen.model_hw for t in trajectories for screen in t.screens]
        for grid, model_hw in zip(inputs["image_grid_thw"].tolist(), sizes):
            if self.predictor.policy.size_from_grid(grid) != model_hw:
                raise ResizedAgain(f"the processor resized a {model_hw[1]}x{model_hw[0]} screenshot again: its "
                                   "bounds differ from the model's policy")
        return inputs

    def _encodes(self, trajectory: Trajectory) -> bool:
        """Whether the processor encodes ``trajectory`` alone; if not, it ends ``env_error`` naming its task, its
        turn and the processor's exception (the boundary refuses what an environment can break it with, so what is
        left may be a bug: its type and message stay in the row)."""
        try:
            self._inputs([trajectory])
        except ResizedAgain:
            raise
        except Exception as exc:  # noqa: BLE001 - one trajectory's conversation: it ends, the others play on
            trajectory.end = ENV_ERROR
            trajectory.message = (f"task {describe_task(trajectory.job.task)} (seed {trajectory.job.seed}), turn "
                                  f"{len(trajectory.screens)}: the conversation cannot be encoded: "
                                  f"{type(exc).__name__}: {exc}")
            return False
        return True

    def _batch(self, trajectories: list[Trajectory], live: list[int]) -> tuple[list[int], Any]:
        """The live trajectories the processor encodes and their batch; only when the whole batch fails is each
        tried alone (``_encodes``), so one trajectory's conversation cannot stop the run."""
        try:
            return live, self._inputs([trajectories[i] for i in live])
        except ResizedAgain:
            raise
        except Exception as batch_error:  # noqa: BLE001 - told apart below, one trajectory at a time
            live = [i for i in live if self._encodes(trajectories[i])]
            try:
                return live, self._inputs([trajectories[i] for i in live]) if live else None
            except ResizedAgain:
                raise
            except Exception as exc:  # noqa: BLE001 - each encodes alone, together they do not: no trajectory's fault
                raise RuntimeError(f"the processor encodes each of {len(live)} trajectories alone but not together "
                                   f"({type(exc).__name__}: {exc}; first {type(batch_error).__name__}: {batch_error}); "
                                   "please report this with the environment") from exc

    def _answers(self, trajectories: list[Trajectory], live: list[int]) -> tuple[list[int], list[str]]:
        """The live trajectories whose conversation and answer fit ``max_tokens``, and their answers; the others end
        ``context`` (the latest screen not shown: no screenshot is cut from its tokens) or, when the processor cannot
        encode them, ``env_error`` (``_batch``)."""
        live, inputs = self._batch(trajectories, live)
        if not live:
            return [], []
        lengths = inputs["attention_mask"].sum(dim=1).tolist()
        kept = []
        for i, length in zip(live, lengths):
            if length + self.predictor.max_new_tokens > self.max_tokens:
                trajectories[i].end = CONTEXT
                trajectories[i].message = (f"turn {len(trajectories[i].screens)}: the conversation is {length} tokens; "
                                           f"with {self.predictor.max_new_tokens} new ones it passes --max-tokens "
                                           f"{self.max_tokens}")
            else:
                kept.append(i)
        if not kept:
            return [], []
        if len(kept) < len(live):
            inputs = self._inputs([trajectories[i] for i in kept])
        return kept, self.answer([trajectories[i] for i in kept], inputs)

    def answer(self, trajectories: list[Trajectory], inputs: Any) -> list[str]:
        """The model's answers to ``inputs``, the conversations of ``trajectories`` (a scripted agent's, in tests)."""
        return self.predictor.generate(inputs)


class VLLMAgentPlayer(AgentPlayer):
    """``AgentPlayer`` answered by vLLM (``VLLMPredictor.screens``): the same chat-template text of each
    conversation, with all its screenshots in the folder's frame; the processor's batch still decides the context
    rule and checks every screenshot's grid."""

    _call = 0  # the turn within a batch: sampled runs seed each turn's requests apart

    def play(self, jobs: Sequence[AgentTask]) -> list[dict[str, Any]]:
        self._call = 0
        return super().play(jobs)

    def answer(self, trajectories: list[Trajectory], inputs: Any) -> list[str]:
        processor = self.predictor.processor
        texts = [processor.apply_chat_template(self._messages(t), add_generation_prompt=True) for t in trajectories]
        self._call += 1
        return self.predictor.screens(texts, [[screen.image for screen in t.screens] for t in trajectories],
                                      self._call)


def model_max_tokens(config: Any) -> int:
    """The longest sequence the model of ``config`` positions: its text config's ``max_position_embeddings``."""
    config = getattr(config, "text_config", None) or config
    return int(getattr(config, "max_position_embeddings", 0) or 32768)


def tasks_digest(jobs: Sequence[AgentTask]) -> str:
    """A digest of every task, seed and prompt: a resumed run must play the same ones."""
    text = json.dumps([[job.task, job.seed, job.prompt, job.system] for job in jobs], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def play_all(player: AgentPlayer, jobs: Sequence[AgentTask], batch_size: int, output: Any) -> None:
    """Every batch of ``jobs`` not yet in ``output`` (``ResumableOutput``), each appended whole when played."""
    from tqdm import tqdm

    start = output.done
    with tqdm(total=len(jobs), initial=start, desc="agent-eval", unit=" traj", disable=None) as bar:
        for first in range(start, len(jobs), batch_size):
            chunk = jobs[first:first + batch_size]
            player.predictor.seed_batch(first // batch_size)  # sampling: each batch at its own seed
            output.append(player.play(chunk))
            bar.update(len(chunk))


def start_runners(spec: str, kwargs: dict[str, Any], policy: Any, count: int, isolation: str, timeout: float
                  ) -> list[EnvRunner]:
    """``count`` environment slots, started now: a class that cannot load fails before the model loads."""
    runners = [EnvRunner(spec, kwargs, policy=policy, isolation=isolation, timeout=timeout) for _ in range(count)]
    try:
        for outcome in start_all(runners):
            if not outcome.ok:
                raise RuntimeError(f"the environment did not start: {outcome.message}")
    except BaseException:
        for runner in runners:
            runner.shutdown()
        raise
    return runners
