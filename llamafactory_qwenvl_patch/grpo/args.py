"""The GRPO YAML keys, as a subclass of LLaMA-Factory's FinetuningArguments (LF unpacks exactly five dataclasses)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from llamafactory_qwenvl_patch.agent.runner import MAX_TIMEOUT_S
from llamafactory_qwenvl_patch.grpo.algorithm.advantages import ESTIMATOR_REGISTRY, SCALE_REWARDS
from llamafactory_qwenvl_patch.grpo.algorithm.losses import IMPORTANCE_LEVELS, LOSS_TYPES, TAKES_DELTA
from llamafactory_qwenvl_patch.grpo.algorithm.sampler_correction import IS_MODES
from llamafactory_qwenvl_patch.grpo.rewards.builtin import BUILTIN as BUILTIN_REWARDS
from llamafactory_qwenvl_patch.grpo.rollout.shared_prefix import SETTINGS as SHARED_PREFIX_SETTINGS
from llamafactory_qwenvl_patch.scoring.cheats import CheatRules

STAGES = ("pt", "sft", "rm", "ppo", "dpo", "kto", "grpo")
ROLLOUT_BACKENDS = ("hf", "vllm")


BOOL_AS_TEXT = ("grpo_shared_prefix",)  # string keys whose values include true and false
JSON_AS_TEXT = ("grpo_agent_env_kwargs",)  # string keys holding a JSON object, which YAML may write as a mapping
# (low, high, low inclusive, high inclusive) for the numeric keys that have a range; every number must be finite
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "grpo_num_generations": (2, math.inf, True, False),  # advantages are relative within a group
    "grpo_beta": (0, math.inf, True, False),
    "grpo_epsilon": (0, math.inf, True, False),
    "grpo_epsilon_high": (0, math.inf, True, False),
    "grpo_num_iterations": (1, math.inf, True, False),
    "grpo_steps_per_generation": (1, math.inf, True, False),
    "no_cheat_min_length_ratio": (0, 1, True, True),
    "no_cheat_max_repetition": (0, 1, True, True),
    "no_cheat_max_copy": (0, 1, True, True),
    "no_cheat_ngram": (1, math.inf, True, False),
    "grpo_blank_image_ratio": (0, 1, True, True),
    "grpo_blank_image_penalty": (0, math.inf, True, False),
    "grpo_vllm_gpu_memory_utilization": (0, 1, False, True),
    "grpo_vllm_tensor_parallel_size": (1, math.inf, True, False),
    "grpo_vllm_is_cap": (0, math.inf, False, False),
    "grpo_cispo_cap": (0, math.inf, False, False),
    "grpo_delta": (1, math.inf, False, False),
    "grpo_entropy_coef": (-math.inf, math.inf, False, False),
    "grpo_overlong_buffer": (1, math.inf, True, False),
    "grpo_max_resample": (1, math.inf, True, False),
    "grpo_agent_max_turns": (1, math.inf, True, False),
    "grpo_agent_max_tokens": (2, math.inf, True, False),
    "grpo_agent_step_timeout": (0, MAX_TIMEOUT_S, False, True),
    "grpo_agent_max_env_failures": (0, 1, True, True),
    "grpo_agent_step_weight": (0, math.inf, True, False),
    "grpo_agent_gamma": (0, 1, True, True),
}
AGENT_CREDITS = ("trajectory", "gigpo")
AGENT_REFUSED_REWARDS = ("overlong",)  # counts one completion's tokens against max_new_tokens: a trajectory has many


def _typed(name: str, declared: str, value: object) -> object:
    """``value`` of the key ``name`` read as its declared type, strictly: LF builds the arguments from the YAML's
    values as they are, so ``"4"`` reached an int key (a TypeError deep in the trainer), ``"no"`` a bool key (read
    as true) and a YAML list a comma-separated one. A whole number in a float key is a float
    (``grpo_blank_image_penalty: 4`` made the blank-image rewards an integer tensor)."""
    kind = declared.split("|")[0].strip()
    if value is None and "None" in declared:
        return None
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            raise ValueError(f"{name} must be a whole number, got {value!r}")
    elif kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            number = float(value)
        else:
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    elif kind == "str":
        if isinstance(value, str):
            return value
        if isinstance(value, bool) and name in BOOL_AS_TEXT:  # YAML reads `grpo_shared_prefix: true` as a bool
            return str(value).lower()
        if isinstance(value, dict) and name in JSON_AS_TEXT:  # a YAML mapping where the key takes a JSON object
            try:
                return json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name}: the mapping {value!r:.200} is not JSON ({exc})") from None
        hint = " (one comma-separated string, e.g. `iou,format`)" if isinstance(value, (list, tuple)) else ""
        raise ValueError(f"{name} must be a string, got {value!r}{hint}")
    else:
        raise TypeError(f"{name}: no strict reading for its declared type {declared!r}")
    if name in RANGES:
        low, high, low_in, high_in = RANGES[name]
        if not ((number >= low if low_in else number > low) and (number <= high if high_in else number < high)):
            bounds = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
            raise ValueError(f"{name} must be in {bounds}, got {value!r}")
    return number


def _read_keys_as_typed(args: object, declared: dict[str, str]) -> None:
    """Every ``grpo_*``, ``no_cheat_*`` and ``reward_*`` key the plugin declares read as its declared type and range
    (``_typed``). ``declared``: the class's own annotations as written (``"float | None"``); a field's ``type`` is no
    witness, since ``HfArgumentParser`` (LF's parser) rewrites it in place when it is built (``float | None`` becomes
    ``float``)."""
    for name, annotation in declared.items():
        if name.startswith(("grpo_", "no_cheat_", "reward_")):
            setattr(args, name, _typed(name, annotation, getattr(args, name)))


def extend_finetuning_arguments(base: type) -> type:
    """FinetuningArguments with ``stage: grpo`` and the ``reward_*`` / ``grpo_*`` keys."""

    @dataclass
    class FinetuningArguments(base):
        stage: Literal[STAGES] = field(default="sft", metadata={"help": "Which stage will be performed in training."})
        reward_funcs: str | None = field(
            default=None,
            metadata={"help": f"GRPO rewards, comma separated: built-ins {', '.join(BUILTIN_REWARDS)}; "
                      "`module:function` or `path/to/file.py:function`."},
        )
        reward_weights: str | None = field(
            default=None, metadata={"help": "Comma-separated weights, one per reward function (default all 1)."}
        )
        grpo_num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (G)."})
        grpo_beta: float = field(
            default=0.04, metadata={"help": "KL coefficient (k3 estimator) to the reference; 0 loads no reference."}
        )
        grpo_epsilon: float = field(default=0.2, metadata={"help": "Lower clip epsilon of the policy ratio."})
        grpo_epsilon_high: float | None = field(
            default=None, metadata={"help": "Upper clip epsilon (default: grpo_epsilon)."}
        )
        grpo_loss_type: str = field(default="grpo", metadata={"help": f"One of {', '.join(LOSS_TYPES)}."})
        grpo_cispo_cap: float = field(
            default=5.0, metadata={"help": "cispo: upper bound of the stop-gradient importance weight (trl's "
                                   "epsilon_high under cispo; ScaleRL recommends 5)."}
        )
        grpo_delta: float | None = field(
            default=None, metadata={"help": "Two-sided clipping: upper bound of the ratio where the advantage is "
                                    "negative (INTELLECT-2; > 1 + grpo_epsilon_high). None = off."}
        )
        grpo_entropy_coef: float = field(
            default=0.0, metadata={"help": "Entropy bonus: the loss minus this x the completions' mean per-token "
                                   "entropy. 0 = off (the entropy is logged either way)."}
        )
        grpo_advantage_estimator: str = field(
            default="grpo", metadata={"help": f"One of {', '.join(ESTIMATOR_REGISTRY)}: group mean/std (GRPO), "
                                      "leave-one-out baseline (RLOO), batch-whitened (REINFORCE++), or group mean "
                                      "then batch-whitened (REINFORCE++-baseline)."}
        )
        grpo_overlong_buffer: int | None = field(
            default=None, metadata={"help": "overlong reward: the last this many of max_new_tokens are the soft "
                                    "punishment zone (DAPO's L_cache; default a fifth of max_new_tokens)."}
        )
        grpo_scale_rewards: str = field(
            default="group", metadata={"help": f"One of {', '.join(SCALE_REWARDS)} (the grpo estimator's scale)."}
        )
        grpo_num_iterations: int = field(
            default=1, metadata={"help": "Optimisation passes over each rollout batch (mu); clipping acts when > 1."}
        )
        grpo_steps_per_generation: int | None = field(
            default=None,
            metadata={"help": "Micro-batches generated at once and then optimised, a multiple of "
                      "gradient_accumulation_steps (default: gradient_accumulation_steps)."},
        )
        grpo_importance_sampling: str = field(
            default="token", metadata={"help": f"Importance ratio per {' or '.join(IMPORTANCE_LEVELS)} (GSPO)."}
        )
        grpo_mask_truncated: bool = field(
            default=False, metadata={"help": "Completions that hit max_new_tokens without a stop token get no loss."}
        )
        grpo_skip_zero_std_groups: bool = field(
            default=False, metadata={"help": "Groups whose rewards are all equal get no loss."}
        )
        grpo_dynamic_sampling: bool = field(
            default=False, metadata={"help": "DAPO's dynamic sampling: groups whose rewards are all equal are "
                                     "replaced by groups of freshly drawn prompts until the batch is full or "
                                     "grpo_max_resample is spent."}
        )
        grpo_max_resample: int = field(
            default=4, metadata={"help": "Dynamic sampling: extra micro-batches of prompts sampled at most per "
                                 "rollout (each per_device_train_batch_size prompts per rank)."}
        )
        no_cheat_min_length_ratio: float = field(
            default=0.25, metadata={"help": "no_cheat: answers shorter than this share of the reference are hacks."}
        )
        no_cheat_max_repetition: float = field(
            default=0.5, metadata={"help": "no_cheat: share of repeated n-grams above which an answer is a hack "
                                   "(and above the reference's own repetition + 0.2)."}
        )
        no_cheat_max_copy: float = field(
            default=0.5, metadata={"help": "no_cheat: share of the answer's n-grams not in the reference that come "
                                   "from the prompt, at or above which it is a copy of the prompt."}
        )
        no_cheat_ngram: int = field(default=3, metadata={"help": "no_cheat: n-gram size (words and punctuation)."})
        grpo_blank_image_ratio: float = field(
            default=0.0, metadata={"help": "Share of prompts also sampled with every image blanked (same size, same "
                                   "image tokens); a confident answer there is penalised. 0 = off."}
        )
        grpo_blank_image_penalty: float = field(
            default=1.0, metadata={"help": "Penalty (negative advantage) of a confident answer on a blank image."}
        )
        grpo_rollout_backend: str = field(
            default="hf", metadata={"help": "Rollout sampler: hf (transformers generate) or vllm (colocated engine)."}
        )
        grpo_vllm_gpu_memory_utilization: float = field(
            default=0.4, metadata={"help": "vllm backend: share of GPU memory for the engine (weights + KV cache)."}
        )
        grpo_vllm_tensor_parallel_size: int = field(
            default=1, metadata={"help": "vllm backend: ranks per engine (tensor parallel); divides the number of "
                                        "training processes."}
        )
        grpo_vllm_is_correction: bool = field(
            default=True, metadata={"help": "vllm backend: correct the loss for the sampler's log-probs with "
                                    "importance weights p_train / p_vllm (grpo_vllm_is_mode)."}
        )
        grpo_vllm_is_mode: str = field(
            default="sequence_mask", metadata={"help": f"vllm backend: one of {', '.join(IS_MODES)}: a ratio per "
                                               "token or per completion, truncated at the cap or masked above it."}
        )
        grpo_vllm_is_cap: float = field(
            default=3.0, metadata={"help": "vllm backend: cap of the importance weight."}
        )
        grpo_shared_prefix: str = field(
            default="auto",
            metadata={"help": "Compute each prompt and its images once per group in the training passes and HF "
                      "rollouts: auto (on wherever the attention implementation allows), true (an error where it "
                      "cannot apply) or false (repeat the prompt for every completion)."},
        )
        grpo_stop_on_reward_failure: bool = field(
            default=True,
            metadata={"help": "Stop the run when a reward fails (raises, NaN or inf) on every completion of a rollout; "
                      "false: those completions score 0 and training goes on. Each reward's first failure is "
                      "logged with its traceback either way."},
        )
        grpo_log_completions: bool = field(
            default=True,
            metadata={"help": "Write prompts, completions and rewards to completions.jsonl in output_dir (on by "
                      "default: reading completions is how reward hacks and format failures are found)."},
        )

        grpo_agent_env: str | None = field(
            default=None,
            metadata={"help": "Multi-turn GUI-agent rollouts: the environment class, `module:Class` or "
                      "`path/to/env.py:Class` (docs/agents.md). Each record is a task; its meta reaches reset()."},
        )
        grpo_agent_env_kwargs: str | None = field(
            default=None, metadata={"help": "The environment class's keyword arguments: a JSON object as text, or a "
                                    "YAML mapping."}
        )
        grpo_agent_max_turns: int = field(default=8, metadata={"help": "Actions per trajectory at most."})
        grpo_agent_max_tokens: int = field(
            default=8192, metadata={"help": "Tokens per trajectory at most: the prompt, every screenshot and every "
                                    "action; an observation that would pass it ends the trajectory (`context`)."}
        )
        grpo_agent_step_timeout: float = field(
            default=60.0, metadata={"help": "Seconds each reset, step and close may take; a hung environment is "
                                    "killed with its worker process (`env_timeout`)."}
        )
        grpo_agent_isolation: str = field(
            default="process", metadata={"help": "process (each environment in a worker process, killed on timeout) "
                                         "or inline (threads, for pure-Python simulators; a hang cannot be killed)."}
        )
        grpo_agent_max_env_failures: float = field(
            default=0.5, metadata={"help": "Share of a rollout's trajectories that may end in an environment failure "
                                   "(error or timeout); above it every rank stops."}
        )
        grpo_agent_credit: str = field(
            default="trajectory", metadata={"help": "trajectory: every action token gets its trajectory's advantage; "
                                            "gigpo: plus grpo_agent_step_weight x its step's advantage within the "
                                            "steps of its task's group taken from the same environment state "
                                            "(info['state_key'])."}
        )
        grpo_agent_step_weight: float = field(
            default=1.0, metadata={"help": "gigpo: the weight of the step advantage beside the trajectory's."}
        )
        grpo_agent_gamma: float = field(
            default=0.95, metadata={"help": "gigpo: the discount of the return from a step on."}
        )

        def __post_init__(self) -> None:
            super().__post_init__()
            _read_keys_as_typed(self, DECLARED)
            if self.grpo_epsilon_high is None:
                self.grpo_epsilon_high = self.grpo_epsilon
            if self.grpo_epsilon_high < self.grpo_epsilon:
                raise ValueError(f"grpo_epsilon_high ({self.grpo_epsilon_high}) must be at least grpo_epsilon "
                                 f"({self.grpo_epsilon}): the clip range would be inverted")
            if self.stage != "grpo":
                return
            if not self.reward_funcs:
                raise ValueError("stage: grpo needs reward_funcs, e.g. `reward_funcs: iou,format`")
            for key, value, allowed in (("grpo_loss_type", self.grpo_loss_type, LOSS_TYPES),
                                        ("grpo_scale_rewards", self.grpo_scale_rewards, SCALE_REWARDS),
                                        ("grpo_importance_sampling", self.grpo_importance_sampling,
                                         IMPORTANCE_LEVELS),
                                        ("grpo_advantage_estimator", self.grpo_advantage_estimator,
                                         ESTIMATOR_REGISTRY),
                                        ("grpo_vllm_is_mode", self.grpo_vllm_is_mode, IS_MODES)):
                if value not in allowed:
                    raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
            takes_scale = ESTIMATOR_REGISTRY[self.grpo_advantage_estimator].takes_scale
            if not takes_scale and self.grpo_scale_rewards != "group":
                raise ValueError(f"grpo_scale_rewards: {self.grpo_scale_rewards} scales the grpo estimator's "
                                 f"advantages; {self.grpo_advantage_estimator} has its own scale (see docs/grpo.md)")
            if self.grpo_delta is not None and self.grpo_delta <= 1 + self.grpo_epsilon_high:
                raise ValueError(f"grpo_delta ({self.grpo_delta}) must be above 1 + grpo_epsilon_high "
                                 f"({1 + self.grpo_epsilon_high}): below it, it clips inside the trust region")
            surrogate = LOSS_TYPES[self.grpo_loss_type][0]
            if self.grpo_delta is not None and surrogate not in TAKES_DELTA:
                raise ValueError(f"grpo_delta caps the ratio of the {' and '.join(sorted(TAKES_DELTA))} surrogate; "
                                 f"grpo_loss_type {self.grpo_loss_type} is the {surrogate} surrogate, which does not "
                                 "take it (docs/grpo.md, the loss types)")
            if self.grpo_rollout_backend not in ROLLOUT_BACKENDS:
                raise ValueError(f"grpo_rollout_backend must be one of {', '.join(ROLLOUT_BACKENDS)}, "
                                 f"got {self.grpo_rollout_backend!r}")
            self.grpo_shared_prefix = self.grpo_shared_prefix.lower()
            if self.grpo_shared_prefix not in SHARED_PREFIX_SETTINGS:
                raise ValueError(f"grpo_shared_prefix must be one of {', '.join(SHARED_PREFIX_SETTINGS)}, "
                                 f"got {self.grpo_shared_prefix!r}")
            _check_agent_keys(self)

        @property
        def cheat_rules(self) -> CheatRules:
            return CheatRules(self.no_cheat_min_length_ratio, self.no_cheat_max_repetition, self.no_cheat_max_copy,
                              self.no_cheat_ngram)

    DECLARED = dict(FinetuningArguments.__annotations__)  # as written: strings, under postponed annotations
    return FinetuningArguments


def agent_env_kwargs(text: str | None) -> dict[str, Any]:
    """``grpo_agent_env_kwargs``: a JSON object as text (LF hands YAML values on as written), or nothing."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except ValueError as exc:
        raise ValueError(f"grpo_agent_env_kwargs must be a JSON object as text, e.g. '{{\"screens\": 3}}' (or a YAML "
                         f"mapping): {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"grpo_agent_env_kwargs must be a JSON object, got {type(value).__name__}")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = next((key for key in keys if keys.count(key) > 1), None)
    if repeated is not None:
        raise ValueError(f"the key {repeated!r} appears twice (a JSON reader keeps one of them)")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_agent_keys(args: Any) -> None:
    """The agent keys among themselves and against the stage's other keys, and the environment class itself (loaded
    and checked against the protocol here, so a misspelt or broken class costs no model load; no environment is
    made or started)."""
    from llamafactory_qwenvl_patch.agent.loading import load_env_class
    from llamafactory_qwenvl_patch.agent.runner import ISOLATIONS
    from llamafactory_qwenvl_patch.grpo.rewards.agent import AGENT_REWARDS

    names = [spec.strip() for spec in (args.reward_funcs or "").split(",")]
    if args.grpo_agent_env is None:
        needing = [name for name in names if name in AGENT_REWARDS]
        if needing:
            raise ValueError(f"reward {needing[0]!r} scores environment trajectories: it needs grpo_agent_env")
        return
    if ":" not in args.grpo_agent_env:
        raise ValueError(f"grpo_agent_env must be module:Class or path/to/env.py:Class, got {args.grpo_agent_env!r}")
    agent_env_kwargs(args.grpo_agent_env_kwargs)
    if args.grpo_agent_isolation not in ISOLATIONS:
        raise ValueError(f"grpo_agent_isolation must be one of {', '.join(ISOLATIONS)}, "
                         f"got {args.grpo_agent_isolation!r}")
    if args.grpo_agent_credit not in AGENT_CREDITS:
        raise ValueError(f"grpo_agent_credit must be one of {', '.join(AGENT_CREDITS)}, got {args.grpo_agent_credit!r}")
    refused = [(key, why) for key, on, why in (
        ("grpo_blank_image_ratio", args.grpo_blank_image_ratio > 0, "the blank-image control blanks a prompt's own "
         "images; an agent's screenshots come from the environment"),
    ) if on]
    refused += [(f"reward_funcs: {name}", "it counts one completion's tokens; a trajectory has many actions")
                for name in names if name in AGENT_REFUSED_REWARDS]
    if refused:
        key, why = refused[0]
        raise ValueError(f"{key} cannot be used with grpo_agent_env: {why}")
    load_env_class(args.grpo_agent_env)  # last: the user's module is imported only for keys that pass


def check_with_other_keys(finetuning_args: Any, model_args: Any, training_args: Any) -> None:
    """The rules between a ``stage: grpo`` key and a key of another of LF's argument classes, which
    ``__post_init__`` cannot see: checked where LF has parsed all of them (``integration.parser_patch``), before
    anything loads, so that a conflict costs no model load."""
    steps, accumulation = finetuning_args.grpo_steps_per_generation, training_args.gradient_accumulation_steps
    if steps is not None and steps % accumulation:
        raise ValueError(f"grpo_steps_per_generation ({steps}) must be a multiple of gradient_accumulation_steps "
                         f"({accumulation}): a rollout covers whole optimiser steps")
    if training_args.load_best_model_at_end and training_args.metric_for_best_model in (None, "loss", "eval_loss"):
        raise ValueError("stage: grpo logs no eval_loss; with load_best_model_at_end set metric_for_best_model "
                         "to a GRPO eval metric, e.g. `metric_for_best_model: eval_reward` and "
                         "`greater_is_better: true`")
    if finetuning_args.grpo_shared_prefix == "true" and model_args.flash_attn == "fa2":
        raise ValueError("grpo_shared_prefix: true needs sdpa or eager attention, and flash_attn is fa2 "
                         "(variable-length flash attention over the packed group is not implemented): set "
                         "grpo_shared_prefix: auto (under fa2 each prompt is repeated for every completion) or "
                         "flash_attn: sdpa")
    if finetuning_args.grpo_agent_env and not model_args.qwenvl_patch:
        raise ValueError("grpo_agent_env needs `qwenvl_patch: true` (with image_min_pixels / image_max_pixels): "
                         "every screenshot is put in the pinned frame and every action mapped back through it")
    if finetuning_args.grpo_rollout_backend != "vllm":
        return
    if not model_args.qwenvl_patch:
        raise ValueError("grpo_rollout_backend: vllm needs `qwenvl_patch: true` (with image_min_pixels / "
                         "image_max_pixels): vLLM must resize exactly as training does")
    size, world = finetuning_args.grpo_vllm_tensor_parallel_size, training_args.world_size
    if world % size:
        raise ValueError(f"grpo_vllm_tensor_parallel_size {size} must divide the number of training processes "
                         f"({world}): each group of {size} ranks shares one engine")
    from llamafactory_qwenvl_patch.grpo.generation.vllm_engine import check_vllm

    check_vllm()
