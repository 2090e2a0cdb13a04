"""transformers releases a user can end up on that are wrong or crash, and what the plugin does about each.

- 5.3.0 to 5.5.4 compute Qwen2-VL / Qwen2.5-VL M-RoPE positions wrong (still images 2 x start up to 5.5.3,
  huggingface/transformers#45325; every video frame the same temporal position up to 5.5.4, #45381).
  ``pyproject.toml`` excludes them; a user who forced one in (``--no-deps``) is refused before anything loads,
  since a fine-tune there learns positions the model never saw (``refuse_wrong_positions``, from the parser).
- 5.6.0, the tested set's release, calls ``s_aux.to(query.dtype)`` on the ``None`` of every model without
  attention sinks in ``flash_attention_forward``: ``flash_attn: fa2`` crashes on the first forward
  (hiyouga/LlamaFactory#10610, #45588). 5.6.2 guards it, but LF 0.9.5 refuses 5.6.2, so a pinned run gets that
  guard here, on that release only (``guard_flash_attention_sinks``, at model load).
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
from types import ModuleType
from typing import Any, Callable

from llamafactory_qwenvl_patch.frame.families import family_for_template, family_of_model, pinned_rope_families
from llamafactory_qwenvl_patch.integration.patching import _rebind

# (first, last) release with the bug, inclusive, and what it gets wrong
POSITION_BUGS = (
    ((5, 3, 0), (5, 5, 3), "still images get temporal position 2 x their start (huggingface/transformers#45325)"),
    ((5, 3, 0), (5, 5, 4), "every video frame gets the same temporal position (huggingface/transformers#45381)"),
)
SINK_BUG_RELEASES = ((5, 6, 0),)
SINK_BUG = "s_aux=s_aux.to(query.dtype),"  # the line as 5.6.0 has it
SINK_FIX = "s_aux=s_aux.to(query.dtype) if s_aux is not None else None,"  # 5.6.2's guard, on one line
TF457 = "the transformers 4.57 set (pip install -c constraints-tf457.txt -e .)"


class TransformersReleaseError(RuntimeError):
    """The installed transformers is a release the plugin cannot run this way."""


def _release(version: str) -> tuple[int, int, int]:
    from packaging.version import Version

    return (*Version(version).release, 0, 0)[:3]


def position_problems(version: str) -> list[str]:
    """What ``version`` gets wrong in Qwen2-VL / Qwen2.5-VL positions (empty: nothing known)."""
    release = _release(version)
    return [what for first, last, what in POSITION_BUGS if first <= release <= last]


def refuse_wrong_positions(model_args: Any, data_args: Any) -> None:
    """Refuse a Qwen2-VL / Qwen2.5-VL run on a release with wrong positions, before anything loads. The family is
    the checkpoint's, else the template's; a run neither names as one of those two is not refused."""
    import transformers

    problems = position_problems(transformers.__version__)
    family = family_of_model(model_args.model_name_or_path) or family_for_template(data_args.template)
    if problems and family in pinned_rope_families():  # those releases broke their get_rope_index
        raise TransformersReleaseError(
            f"transformers {transformers.__version__} computes Qwen2-VL and Qwen2.5-VL positions wrong (this run's "
            f"family: {family}): {'; '.join(problems)}. "
            "A run here would train at positions the model never saw and be served at others, so "
            "llamafactory-qwenvl-patch excludes transformers 5.3.0 to 5.5.4. Install the tested set "
            f"(pip install -c constraints.txt -e ., transformers 5.6.0) or {TF457}.")


def guard_flash_attention_sinks() -> bool:
    """On a release with the ``None`` sink crash, put 5.6.2's guard into ``flash_attention_forward`` (its own
    source, that one line changed, compiled in its module) wherever transformers holds the function; True when the
    installed function is guarded. Every other release, and a 5.6.0 whose source has no such line, is left as is."""
    import transformers

    if _release(transformers.__version__) not in SINK_BUG_RELEASES:
        return False
    module = _require("transformers.integrations.flash_attention",
                      ["flash_attention_forward", "_flash_attention_forward"])
    interface = _require("transformers.modeling_utils", ["AttentionInterface"]).AttentionInterface
    if not isinstance(getattr(interface, "_global_mapping", None), dict):
        raise _moved("transformers.modeling_utils.AttentionInterface has no _global_mapping")
    original = module.flash_attention_forward
    if getattr(original, "__qwenvl_unpatched__", None) is not None:
        return True
    guarded = _with_sink_guard(original)
    if guarded is None:
        return False
    guarded.__qwenvl_unpatched__ = original
    for key, value in list(interface._global_mapping.items()):
        if value is original:
            interface._global_mapping[key] = guarded
    _rebind(original, guarded, package="transformers")  # modeling_utils and hub_kernels import it by name
    return True


def _with_sink_guard(original: Callable) -> Callable | None:
    """``original`` recompiled from its source with 5.6.2's guard, in its own module's namespace (so it calls what
    the original calls); None when its source has no unguarded sink."""
    try:
        lines, first = inspect.getsourcelines(original)
    except (OSError, TypeError) as error:
        raise _moved(f"the source of flash_attention_forward cannot be read ({error}), so the fix of "
                     "huggingface/transformers#45588 cannot be applied") from None
    source = textwrap.dedent("".join(lines))
    if SINK_BUG not in source:
        return None
    code = compile("\n" * (first - 1) + source.replace(SINK_BUG, SINK_FIX), inspect.getsourcefile(original), "exec")
    namespace: dict[str, Any] = {}
    exec(code, original.__globals__, namespace)  # noqa: S102 - transformers' own source, one line changed
    return namespace[original.__name__]


def _require(name: str, names: list[str]) -> ModuleType:
    module = importlib.import_module(name)
    missing = [attr for attr in names if not hasattr(module, attr)]
    if missing:
        raise _moved(f"{name} has no {', '.join(missing)}")
    return module


def _moved(what: str) -> TransformersReleaseError:
    import transformers

    return TransformersReleaseError(
        f"transformers {transformers.__version__}: {what}. `flash_attn: fa2` crashes on this release without that "
        f"fix: set `flash_attn: sdpa`, or install {TF457}, whose flash attention has no such bug.")
