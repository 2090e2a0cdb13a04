"""Multi-turn rollouts: G trajectories per task, turn-synchronous. Each turn samples one action for every live
trajectory (``Sampler``: HF ``generate`` or vLLM, given whole rows), reads it in that turn's screenshot frame, sends it
to the environments in parallel (``agent.runner``) and appends what they answer, rendered by LF's template
(``rollout.turns``), until the environment says done, the turns run out, the next observation would not fit, or the
environment fails.

Token in, token out: a sampled action stays the ids sampled (its stop token included); only the environment's side is
rendered. A trajectory ended by an environment failure keeps its segments but is marked ``failed``: it gets no loss
and leaves its group's baseline. An observation the renderer cannot take ends its trajectories the same way
(``env_error``, the renderer's exception in the message), never the run; a ``close()`` that fails is kept on its
episode (``close_error``) for the trainer to log and count.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from llamafactory_qwenvl_patch.agent.frame import Screen, ScreenshotError, model_screen, read_action
from llamafactory_qwenvl_patch.agent.runner import ENV_ERROR, EnvRunner, close_all, reset_all, step_all
from llamafactory_qwenvl_patch.agent.checks import group_start_error, json_value
from llamafactory_qwenvl_patch.agent.types import INVALID, Action
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.grpo.rollout.turns import TurnRenderer, append_observation
from llamafactory_qwenvl_patch.grpo.rollout.types import Segment, Trajectory

DONE, TURNS = "done", "turns"  # the environment said done; grpo_agent_max_turns actions were taken
FAILURES = ("env_error", "env_timeout")

# rows (ids), their images (model-input screenshots, in order) and their tasks (positions in the rollout's task list)
# -> per row: sampled ids (stop token included when
# it stopped), whether it stopped, its text, and the sampler's log-prob of each id (None: the sampler is the model)
Sampled = tuple[list[list[int]], list[bool], list[str], list[list[float]] | None]
Sampler = Callable[[list[list[int]], list[list[Any]], list[int]], Sampled]


class AgentRunError(RuntimeError):
    """A task the run cannot roll out (its G resets differ, its first screen does not fit the token budget)."""


@dataclass(frozen=True)
class Task:
    """One record as a task: its meta (``reset``'s argument), the prompt messages LF aligned, its system prompt and
    tools, and the name messages use."""

    meta: Any
    prompt: list[dict[str, str]]
    system: str | None
    tools: str | None
    name: str


@dataclass(eq=False)
class Episode:
    """One trajectory as it is rolled out: its root (the task with the first screenshot), the trajectory after it,
    each turn's record for the rewards, and how it ended."""

    task: int  # position of its task in the rollout's list
    root: Segment | None = None
    trajectory: Trajectory = field(default_factory=Trajectory)
    turns: list[dict[str, Any]] = field(default_factory=list)
    screen: Screen | None = None  # the screenshot the next action answers
    sampling_logps: list[float] = field(default_factory=list)  # the sampler's, per action token (vLLM)
    stopped: bool = True  # the last action ended with its stop token
    cut: int = 0  # actions cut at max_new_tokens before their stop token
    message: str = ""  # why it failed
    close_error: str = ""  # why its environment's close() failed, if it did

    @property
    def end(self) -> str | None:
        return self.trajectory.end

    @property
    def failed(self) -> bool:
        return self.end in FAILURES

    def finish(self, end: str, message: str = "") -> None:
        self.trajectory = self.trajectory.ended(end)
        self.message = self.message or message

    def record(self) -> dict[str, Any]:
        """What rewards receive as ``trajectories``: every turn and the end."""
        return {"turns": self.turns, "end": self.end}

    @property
    def actions_text(self) -> str:
        """The trajectory as one completion for text rewards and the completions log: its actions, one per line."""
        return "\n".join(turn["text"] for turn in self.turns)


@dataclass(frozen=True)
class EpisodeSettings:
    policy: ResizePolicy
    convention: str  # the family's point convention (model or rel1000)
    max_turns: int
    max_tokens: int
    max_new_tokens: int


def _action_dict(action: Action) -> dict[str, Any]:
    return {key: getattr(action, key) for key in ("kind", "x", "y", "text", "direction", "key", "reason")
            if getattr(action, key) is not None}


def run_episodes(tasks: Sequence[Task], G: int, runners: Sequence[EnvRunner], seeds: Sequence[int],
                 renderer: TurnRenderer, sample: Sampler, settings: EpisodeSettings,
                 in_step: Callable[[bool], bool] | None = None) -> list[Episode]:
    """G episodes per task (task-major), on ``runners`` (one per episode); every environment is closed at the end,
    each failed close kept on its episode. ``in_step`` (a sampler whose calls are collectives, a tensor-parallel
    engine): told each turn whether this rank has a live episode, it says whether any rank has; the turns go on
    while one does, a rank with none joining each call with no request."""
    episodes = [Episode(i) for i in range(len(tasks)) for _ in range(G)]
    try:
        _start(tasks, G, runners, seeds, renderer, settings, episodes)
        turn = 1
        while True:
            live = [k for k, e in enumerate(episodes) if e.end is None]
            if not (in_step(bool(live)) if in_step is not None else live):
                break
            if live:
                _act([episodes[k] for k in live], [runners[k] for k in live], tasks, renderer, sample, settings,
                     turn)
            else:
                sample([], [], [])
            turn += 1
    finally:
        for e, outcome in zip(episodes, close_all(runners)):
            e.close_error = "" if outcome.ok else outcome.message
    return episodes


def _start(tasks: Sequence[Task], G: int, runners: Sequence[EnvRunner], seeds: Sequence[int],
           renderer: TurnRenderer, settings: EpisodeSettings, episodes: list[Episode]) -> None:
    """Reset every environment (a group: one task and seed G times) and render each group's root once."""
    outcomes = reset_all(runners, [t.meta for t in tasks for _ in range(G)], [s for s in seeds for _ in range(G)],
                         [t.name for t in tasks for _ in range(G)])
    for i, task in enumerate(tasks):
        group = list(range(i * G, (i + 1) * G))
        for k in group:
            if not outcomes[k].ok:
                episodes[k].finish(outcomes[k].status, _described(outcomes[k]))
        alive = [k for k in group if outcomes[k].ok]
        if not alive:
            continue
        error = group_start_error([outcomes[k].value for k in alive], task.name)
        if error is not None:
            raise AgentRunError(error)
        first = outcomes[alive[0]].value
        try:
            screen = model_screen(first.image, settings.policy)
        except ScreenshotError as exc:
            for k in alive:
                episodes[k].finish(ENV_ERROR, f"task {task.name}: the first screenshot is {exc}")
            continue
        try:
            root = renderer.root(task.prompt, screen.image, first.text, task.system, task.tools)
        except Exception as exc:  # noqa: BLE001 - see _unrendered
            for k in alive:
                episodes[k].finish(ENV_ERROR, _unrendered(task, 1, exc))
            continue
        if len(root.ids) + settings.max_new_tokens > settings.max_tokens:
            raise AgentRunError(f"task {task.name}: its prompt with the first {first.image.width}x{first.image.height}"
                                f" screenshot is {len(root.ids)} tokens, and with one action of max_new_tokens "
                                f"({settings.max_new_tokens}) it passes grpo_agent_max_tokens "
                                f"({settings.max_tokens}): raise grpo_agent_max_tokens or lower image_max_pixels")
        for k in alive:
            episodes[k].root, episodes[k].screen = root, screen


def _act(live: list[Episode], runners: list[EnvRunner], tasks: Sequence[Task], renderer: TurnRenderer,
         sample: Sampler, settings: EpisodeSettings, turn: int) -> None:
    """One turn of every live episode: sample, read, step, render the next observation."""
    rows = [list(e.root.ids) + e.trajectory.rows()[0] for e in live]
    images = [[*e.root.images, *e.trajectory.images] for e in live]
    ids, stopped, texts, logps = sample(rows, images, [e.task for e in live])
    actions = []
    for k, (e, action_ids, stop, text) in enumerate(zip(live, ids, stopped, texts)):
        e.trajectory = e.trajectory.extended(Segment("model", tuple(action_ids)))
        if logps is not None:
            e.sampling_logps += logps[k][:len(action_ids)]
        e.stopped = stop
        e.cut += not stop
        screen = e.screen
        action = read_action(text, settings.convention, screen.orig_hw, screen.model_hw) if stop else \
            Action(INVALID, raw=text, reason=f"cut at max_new_tokens ({settings.max_new_tokens}) before its stop "
                   "token")
        actions.append(action)
        e.turns.append({"text": text, "action": _action_dict(action), "reward": 0.0, "info": {},
                        "orig_hw": list(screen.orig_hw), "model_hw": list(screen.model_hw)})
    outcomes = step_all(runners, actions)
    for e, outcome in zip(live, outcomes):
        if not outcome.ok:
            e.finish(outcome.status, _described(outcome))
            continue
        step = outcome.value
        e.turns[-1].update(reward=step.reward, info=json_value(step.info))
        if step.done:
            e.finish(DONE)
        elif turn >= settings.max_turns:
            e.finish(TURNS)
        else:
            _observe(e, step.observation, tasks[e.task], renderer, settings, turn + 1)


def _observe(e: Episode, observation: Any, task: Task, renderer: TurnRenderer, settings: EpisodeSettings,
             turn: int) -> None:
    """Append ``o_turn``, or end the episode: a screenshot the frame refuses or an observation the renderer cannot
    take (``env_error``), or one that would pass the token budget with room for a whole next action (``context``: no
    image without its tokens)."""
    try:
        screen = model_screen(observation.image, settings.policy)
    except ScreenshotError as exc:
        e.finish(ENV_ERROR, f"task {task.name}: the screenshot for turn {turn} is {exc}")
        return
    try:
        segment = renderer.observation(task.prompt, turn, screen.image, observation.text, e.stopped, task.system,
                                       task.tools)
    except Exception as exc:  # noqa: BLE001 - see _unrendered
        e.finish(ENV_ERROR, _unrendered(task, turn, exc))
        return
    e.trajectory = append_observation(e.root, e.trajectory, segment, settings.max_tokens, settings.max_new_tokens)
    if e.end is None:
        e.screen = screen


def _described(outcome: Any) -> str:
    """An environment failure's message, with the environment's own traceback when it raised."""
    return outcome.message + (f"\n{outcome.traceback}" if outcome.traceback else "")


def _unrendered(task: Task, turn: int, exc: Exception) -> str:
    """Why an observation the renderer raised on ends its trajectories: the boundary's checks refuse what an
    environment can break it with, so what is left may be a bug; its type, message and traceback stay in the
    trajectory's message (logged with the first failure) rather than being hidden or crashing the run."""
    trace = "".join(traceback.format_exception(exc)).rstrip()
    return f"task {task.name}, turn {turn}: the observation cannot be rendered: {type(exc).__name__}: {exc}\n{trace}"


def trie_saving(rows: Sequence[Sequence[int]]) -> float:
    """The share of the tokens of ``rows`` (a group's trajectories after their shared root) that a prefix tree would
    not compute again: 1 - distinct prefixes / tokens. The number the shared-prefix-across-turns decision waits for."""
    total = sum(len(row) for row in rows)
    if not total:
        return 0.0
    root: dict[int, dict] = {}
    nodes = 0
    for row in rows:
        node = root
        for token in row:
            if token not in node:
                node[token] = {}
                nodes += 1
            node = node[token]
    return 1.0 - nodes / total
