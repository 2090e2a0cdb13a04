"""``qwen_vl_utils.smart_resize`` without importing torch.

``qwen_vl_utils`` imports torch and torchvision at module level (about 3 s and 850 MB here) although ``smart_resize``
is plain integer math. Tools that only need sizes (``qwenvl-prep convert``) compile the installed
qwen-vl-utils' *own* source of ``smart_resize`` and its helpers, unchanged, into a namespace of their own. If the
module's layout is not the one expected, or qwen_vl_utils is already imported, the real function is used.
``tests/unit/frame/test_policy.py`` checks both give identical results.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
import typing
from pathlib import Path
from typing import Callable

NEEDED = {"smart_resize", "round_by_factor", "ceil_by_factor", "floor_by_factor"}


def _compile_from_source() -> Callable | None:
    spec = importlib.util.find_spec("qwen_vl_utils")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "vision_process.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError):
        return None
    body = [node for node in tree.body if (isinstance(node, ast.FunctionDef) and node.name in NEEDED)
            or (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)
                and isinstance(node.value, ast.Constant))]
    if {node.name for node in body if isinstance(node, ast.FunctionDef)} != NEEDED:
        return None
    namespace = {"math": math, **{name: getattr(typing, name) for name in ("Optional", "Tuple", "Union", "List")}}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["smart_resize"]


def load_smart_resize() -> Callable:
    """The installed qwen-vl-utils' ``smart_resize``: its real module if loaded, else its source compiled alone."""
    module = sys.modules.get("qwen_vl_utils")
    if module is not None:
        return module.smart_resize
    try:
        compiled = _compile_from_source()
    except Exception:  # noqa: BLE001 - any surprise in the source means: use the real import
        compiled = None
    if compiled is not None:
        return compiled
    from qwen_vl_utils import smart_resize

    return smart_resize
