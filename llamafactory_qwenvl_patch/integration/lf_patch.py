"""The patches applied to LLaMA-Factory modules right after they load (see ``_hook``): the one place the hook looks
them up by name. Each lives in the module for the LF part it patches (``parser_patch``, ``model_patch``,
``template_patch``, ``data_patch``, ``tuner_patch``, ``chat_patch``; shared helpers in ``patching``).

Each patch is inert unless the run opts in with ``qwenvl_patch: true``; without it LLaMA-Factory behaves stock.
"""

from __future__ import annotations

from llamafactory_qwenvl_patch.integration.chat_patch import (
    patch_api_chat, patch_chat_model, patch_hf_engine, patch_vllm_engine,
)
from llamafactory_qwenvl_patch.integration.data_patch import patch_data_loader
from llamafactory_qwenvl_patch.integration.model_patch import patch_model_loader
from llamafactory_qwenvl_patch.integration.parser_patch import patch_parser
from llamafactory_qwenvl_patch.integration.template_patch import patch_template
from llamafactory_qwenvl_patch.integration.tuner_patch import patch_tuner

__all__ = ["patch_api_chat", "patch_chat_model", "patch_data_loader", "patch_hf_engine", "patch_model_loader",
           "patch_parser", "patch_template", "patch_tuner", "patch_vllm_engine"]
