"""Lazy post-import hook, installed at interpreter start by ``llamafactory_qwenvl_patch.pth``.

It imports nothing heavy: it only registers a meta-path finder that notices when specific LLaMA-Factory modules
finish executing and then calls the matching patch function. Every process gets it (single process, each torchrun
rank, dataset workers), because each fresh interpreter reads the ``.pth`` file. ``QWENVL_PATCH_DISABLE=1`` turns it off.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import Loader, MetaPathFinder

DISABLE_ENV = "QWENVL_PATCH_DISABLE"

# LF module -> name of the function in ``llamafactory_qwenvl_patch.integration.lf_patch`` that patches it right
# after it loads.
TARGETS = {
    "llamafactory.hparams.parser": "patch_parser",
    "llamafactory.model.loader": "patch_model_loader",
    "llamafactory.data.template": "patch_template",
    "llamafactory.data.loader": "patch_data_loader",
    "llamafactory.train.tuner": "patch_tuner",
    "llamafactory.chat.chat_model": "patch_chat_model",
    "llamafactory.chat.hf_engine": "patch_hf_engine",
    "llamafactory.chat.vllm_engine": "patch_vllm_engine",
    "llamafactory.api.chat": "patch_api_chat",
}


def _run_patch(module_name: str) -> None:
    from llamafactory_qwenvl_patch.integration import lf_patch

    getattr(lf_patch, TARGETS[module_name])(sys.modules[module_name])


class _PatchingLoader(Loader):
    """Delegates to the real loader, then patches the freshly executed module."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _run_patch(module.__name__)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class PostImportFinder(MetaPathFinder):
    """Finds nothing itself; wraps the loader of the target modules that the other finders find."""

    marker = "llamafactory_qwenvl_patch"

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "marker", None) == self.marker or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def install_from_pth() -> None:
    """The ``.pth`` entry point: like ``install`` unless the environment turns the hook off."""
    if not disabled():
        install()


def install() -> None:
    """Register the finder once (idempotent: a ``.pth`` line can run twice) and patch already-loaded modules."""
    if not any(getattr(finder, "marker", None) == PostImportFinder.marker for finder in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder())
    for name in TARGETS:
        if name in sys.modules:
            _run_patch(name)
