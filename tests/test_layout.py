"""The package's import directions, as each sub-package's ``__init__`` states them: the frame core imports nothing
else from the package; image I/O, scoring and the model-folder files import only the frame core; the GRPO stage imports those three;
LLaMA-Factory integration is imported only by the import hook and the GRPO stage's LF glue (its workflow and the
meta column carried through LF's dataset code); the ``qwenvl-prep`` tool never imports it (it runs without LF's
internals). Every import counts, also those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "llamafactory_qwenvl_patch"
CORE = {"frame"}
ALLOWED = {
    "frame": CORE,
    "image_io": CORE | {"image_io"},
    "scoring": CORE | {"scoring"},
    "model_files": CORE | {"model_files"},
    "grpo": CORE | {"image_io", "scoring", "grpo"},
    "integration": CORE | {"image_io", "scoring", "model_files", "grpo", "integration"},
}
INTEGRATION_USERS = {f"{PKG}._hook", f"{PKG}.grpo.workflow", f"{PKG}.grpo.record_meta"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[1:] if parts[0] == "preprocessing" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every name ``path`` imports from this package or qwenvl-prep (``from pkg import sub`` gives ``pkg.sub``)."""
    found = set()
    ours = (PKG, "qwenvl_prep")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith(ours)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ours):
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def area(module: str) -> str | None:
    """The sub-package of a package module (None for the root package and the top-level hook)."""
    parts = module.split(".")
    if parts[0] != PKG or len(parts) < 2 or not (ROOT / PKG / parts[1]).is_dir():
        return None
    return parts[1]


MODULES = {module_name(p): imports(p) for p in [*(ROOT / PKG).rglob("*.py"), *(ROOT / "preprocessing").rglob("*.py")]}


def test_the_rules_see_the_imports():
    """Not vacuous: the known edges are found, and every sub-package has a rule."""
    assert f"{PKG}.integration.lf_compat" in MODULES[f"{PKG}.grpo.workflow"]
    assert f"{PKG}.integration.lf_patch" in MODULES[f"{PKG}._hook"]
    assert f"{PKG}.frame.policy.ResizePolicy" in MODULES[f"{PKG}.image_io.images"]
    assert {p.name for p in (ROOT / PKG).iterdir() if (p / "__init__.py").exists()} == set(ALLOWED)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_import_directions(module):
    source = area(module)
    for target in sorted(MODULES[module]):
        into = area(target)
        if into == "integration" and source != "integration":
            assert module in INTEGRATION_USERS, f"{module} imports LF integration ({target})"
        elif source in ALLOWED and into is not None:
            assert into in ALLOWED[source], f"{module} ({source}) imports {target} ({into})"


def test_every_sub_package_says_what_it_may_import():
    for name in ALLOWED:
        doc = ast.get_docstring(ast.parse((ROOT / PKG / name / "__init__.py").read_text())) or ""
        assert "May import" in doc, name


def resolved(target: str) -> str | None:
    """The module an imported name lives in (``pkg.frame.policy.ResizePolicy`` -> ``pkg.frame.policy``)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def test_no_import_cycles():
    """Among the package's and qwenvl-prep's modules (the two demos used to import each other)."""
    graph = {m: {t for t in map(resolved, targets) if t and t != m} for m, targets in MODULES.items()}
    assert "qwenvl_prep.demo_steps" in graph["qwenvl_prep.demo_fields"]  # qwenvl-prep's own imports are seen
    graph[PKG] = set()  # the root holds __version__ for everyone; its apply() reaches the hook only when called
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1  # on the current path
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2  # done

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
