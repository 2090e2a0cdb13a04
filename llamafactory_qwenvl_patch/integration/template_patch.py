"""Patches ``llamafactory.data.template``: a pinned run's template gets the pinned multimodal plugin, so LF's own
preprocessing resizes still images under the run's bounds and samples videos under its video policy."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from llamafactory_qwenvl_patch.integration import lf_compat
from llamafactory_qwenvl_patch.integration.patching import _replace


def patch_template(template_module: ModuleType) -> None:
    """Give a pinned run its own template copy whose plugin instance carries the bounds (shared TEMPLATES untouched)."""
    lf_compat.require(template_module, ["get_template_and_fix_tokenizer", "TEMPLATES"])

    def make(get_template: Callable) -> Callable:
        def wrapper(tokenizer: Any, data_args: Any, *args: Any, **kwargs: Any) -> Any:
            template = get_template(tokenizer, data_args, *args, **kwargs)
            policy = getattr(tokenizer, "qwenvl_policy", None)
            if policy is None:
                return template
            from copy import copy

            from llamafactory_qwenvl_patch.integration.plugin import pinned_plugin

            pinned = copy(template)
            pinned.mm_plugin = pinned_plugin(template.mm_plugin, policy, tokenizer.qwenvl_video_policy,
                                             tokenizer.qwenvl_frame_list_fps,
                                             getattr(tokenizer, "qwenvl_image_cache_mb", 0))
            return pinned

        return wrapper

    _replace(template_module, "get_template_and_fix_tokenizer", make)
