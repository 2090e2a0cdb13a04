"""Resize-consistent Qwen-VL grounding fine-tuning for LLaMA-Factory.

Importing this package is cheap on purpose: the ``.pth`` hook imports it in every Python process.
"""

__version__ = "0.1.0"


def apply() -> None:
    """Patch LLaMA-Factory in this process (for Python users; the ``.pth`` hook normally does this already)."""
    from llamafactory_qwenvl_patch import _hook

    _hook.install()
