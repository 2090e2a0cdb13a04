"""The token layout of a multi-turn trajectory: the root (system, the task with its first screenshot, the assistant
prefix) and each observation ``o_t`` (what LF's template puts after an assistant turn's stop word, a user turn with
the new screenshot, the assistant prefix), rendered by LF's template object and its pinned plugin; and the context
rule that ends a trajectory before an observation that would not fit.

Token in, token out: the model's actions are sampled ids and stay ids (``Segment("model", ...)``); nothing here
decodes them. ``o_t`` is the difference between LF's encoding of the conversation up to turn t and up to turn t-1,
so a row ``root | a_1 | o_2 | a_2 ...`` is what LF encodes for the same conversation in one piece (the actions'
text as assistant messages). LF's template and plugin arrive as objects: nothing here imports LLaMA-Factory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.grpo.rollout.types import Segment, Trajectory

CONTEXT = "context"  # the end of a trajectory whose next observation would pass the token budget
_USER, _ASSISTANT = "user", "assistant"  # LF's Role values


class LayoutError(ValueError):
    """A template, prompt or observation the token layout cannot render exactly (the message says what)."""


@dataclass(frozen=True)
class TurnRenderer:
    """One run's renderer: LF's template object (its ``mm_plugin`` pinned to ``policy``), the tokenizer and processor
    LF loaded, and LF's image placeholder (``llamafactory.extras.constants.IMAGE_PLACEHOLDER``). A screenshot may be
    the environment's or its model-input image (``agent.frame.model_screen``): the policy maps a model-input size onto
    itself, so both get the same tokens."""

    template: Any
    tokenizer: Any
    processor: Any
    policy: ResizePolicy
    placeholder: str

    def __post_init__(self) -> None:
        plugin_policy = getattr(self.template.mm_plugin, "policy", None)
        if plugin_policy != self.policy:
            raise LayoutError(f"the template's plugin ({type(self.template.mm_plugin).__name__}) is not pinned to "
                              f"the run's frame {self.policy}: its images would get other token counts")
        own = [cls.__name__ for cls in type(self.template).__mro__ if "encode_multiturn" in vars(cls)]
        if len(own) > 1:  # LF's ReasoningTemplate: it drops or adds thoughts in earlier turns
            raise LayoutError(f"template {type(self.template).__name__} encodes conversations its own way "
                              f"({own[0]}.encode_multiturn): earlier turns would not stay as the model sampled them; "
                              "use a template without it (qwen3_vl_nothink, qwen3_5_nothink)")

    @property
    def stop_id(self) -> int:
        """The template's stop word (``<|im_end|>``): what ends an action and opens each observation."""
        return self.tokenizer.convert_tokens_to_ids(self.template.stop_words[0])

    def root(self, prompt: list[dict[str, str]], screenshot: Any, text: str = "", system: str | None = None,
             tools: str | None = None) -> Segment:
        """The prompt as LF encodes it for stage ppo / grpo (``encode_oneturn`` with an empty answer): ``prompt`` is
        a record's messages (odd, ending with the user's), the first screenshot (and ``text``, the reset's) appended
        to the last one as if it ended in the image placeholder."""
        if not prompt or len(prompt) % 2 != 1 or prompt[-1]["role"] != _USER:
            raise LayoutError(f"a task's prompt is an odd number of messages ending with the user's, got "
                              f"{[m.get('role') for m in prompt]}")
        if any(self.placeholder in message["content"] for message in prompt):
            raise LayoutError(f"a task's prompt holds {self.placeholder}: its screenshots come from the environment")
        last = {"role": _USER, "content": prompt[-1]["content"] + self.placeholder + text}
        messages = self._expand([*prompt[:-1], last, _message(_ASSISTANT)], screenshot)
        ids, _ = self.template.encode_oneturn(self.tokenizer, messages, system, tools)
        ids, _ = self.template.mm_plugin.process_token_ids(ids, None, [screenshot], [], [], self.tokenizer,
                                                           self.processor)
        return self._checked(ids, screenshot)

    def observation(self, prompt: list[dict[str, str]], turn: int, screenshot: Any, text: str = "",
                    stopped: bool = True, system: str | None = None, tools: str | None = None) -> Segment:
        """``o_turn`` (turn >= 2), after the action of turn - 1: LF's encoding of the conversation up to ``turn``
        less its encoding up to ``turn - 1``, without the stop word the action sampled. An action that did not stop
        (cut at ``max_new_tokens``) gets the stop word here, as an untrained environment token, so the row stays
        the conversation LF would encode."""
        if turn < 2:
            raise LayoutError(f"observations start at turn 2 (turn 1 is the root), got {turn}")
        before = [*prompt, *[_message(role) for _ in range(turn - 2) for role in (_ASSISTANT, _USER)]]
        user = self._expand([_message(_USER, self.placeholder + text)], screenshot)
        earlier = self._prompt_ids(before, system, tools)
        later = self._prompt_ids([*before, _message(_ASSISTANT), *user], system, tools)
        if later[:len(earlier)] != earlier:
            raise LayoutError(f"template {type(self.template).__name__} encodes turn {turn - 1} differently once "
                              f"turn {turn} follows: earlier turns would not be what the model saw")
        added = later[len(earlier):]
        if not added or added[0] != self.stop_id:
            raise LayoutError(f"template {type(self.template).__name__} encodes an empty assistant turn as "
                              f"{added[:8]}, not starting with its stop word: it adds tokens the model did not "
                              "sample")
        return self._checked(added if not stopped else added[1:], screenshot)

    def _prompt_ids(self, messages: list[dict[str, str]], system: str | None, tools: str | None) -> list[int]:
        """LF's ids of ``messages`` (ending with the user's) up to and including the assistant prefix."""
        pairs = self.template.encode_multiturn(self.tokenizer, [*messages, _message(_ASSISTANT)], system, tools)
        return [token for prompt, answer in pairs[:-1] for token in prompt + answer] + pairs[-1][0]

    def _expand(self, messages: list[dict[str, str]], screenshot: Any) -> list[dict[str, str]]:
        """The placeholder expanded by the pinned plugin into vision start, pads, vision end."""
        return self.template.mm_plugin.process_messages(messages, [screenshot], [], [], self.processor)

    def _checked(self, ids: list[int], screenshot: Any) -> Segment:
        """An environment segment, its pads counted against the policy (the frame guard of every turn)."""
        pad = self.tokenizer.convert_tokens_to_ids(self.template.mm_plugin.image_token)
        expected = self.policy.image_tokens(screenshot.height, screenshot.width)
        if ids.count(pad) != expected:
            raise LayoutError(f"a {screenshot.width}x{screenshot.height} screenshot got {ids.count(pad)} image "
                              f"tokens, but the frame {self.policy} gives it {expected}")
        return Segment("env", tuple(ids), (screenshot,))


def _message(role: str, content: str = "") -> dict[str, str]:
    return {"role": role, "content": content}


def fits(root: Segment, trajectory: Trajectory, observation: Segment, max_tokens: int, room: int = 1) -> bool:
    """Whether ``observation`` can follow: root, the trajectory so far, the observation and ``room`` tokens for the
    next action (at least its stop token) within ``max_tokens``."""
    return len(root.ids) + trajectory.length + len(observation.ids) + room <= max_tokens


def append_observation(root: Segment, trajectory: Trajectory, observation: Segment, max_tokens: int,
                       room: int = 1) -> Trajectory:
    """The trajectory with ``observation`` appended, or, when it would not fit (``fits``), the trajectory as it
    was, ended ``context``: an observation enters whole or not at all, so no image is kept without its tokens."""
    if fits(root, trajectory, observation, max_tokens, room):
        return trajectory.extended(observation)
    return trajectory.ended(CONTEXT)
