"""Both packages' import directions, as each sub-package's ``__init__`` states them. Every import counts, also those
inside functions.

The plugin: the frame core imports nothing else from the package; image I/O, scoring and the model-folder files
import only the frame core; GUI agents' environments (``agent``) import the frame core, image I/O and scoring; the
GRPO stage imports the frame core, image I/O, scoring and ``agent``, never LLaMA-Factory integration, which is
imported only by the import hook (the GRPO stage's LF glue lives in integration); the ``qwenvl-prep`` tool never
imports it (it runs without LF's internals; its demos may import ``agent``). Inside the GRPO stage each part imports
only those before it: algorithm, rollout, rewards, generation, trainer; its YAML keys (``grpo.args``) may import any.

``qwenvl-prep``: plumbing imports nothing else of the tool; what stock LF does (``lf``) imports only plumbing;
dataset formats import plumbing and ``lf``; the work behind the commands (``pipeline``) and the demos import those
three and never each other (a demo runs the pipeline as a user does, through the CLI in a subprocess); commands
import any of them and each other; nothing imports the CLI, which imports only the commands and plumbing. The
tool's top level holds only the CLI: a new format goes in ``formats/``, a new subcommand in ``commands/``.

No product module is over 500 lines."""

from __future__ import annotations

import ast
import re
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
    "agent": CORE | {"image_io", "scoring", "agent"},
    "grpo": CORE | {"image_io", "scoring", "agent", "grpo"},
    "integration": CORE | {"image_io", "scoring", "model_files", "agent", "grpo", "integration"},
}
INTEGRATION_USERS = {f"{PKG}._hook"}
GRPO_ORDER = ["algorithm", "rollout", "rewards", "generation", "trainer"]  # each part imports only those before it
PREP = "qwenvl_prep"
PREP_ROOT = ROOT / "preprocessing" / PREP
PREP_BELOW = {"plumbing": set(), "lf": {"plumbing"}, "formats": {"plumbing", "lf"},
              "pipeline": {"plumbing", "lf", "formats"}, "demos": {"plumbing", "lf", "formats"},
              "commands": {"plumbing", "lf", "formats", "pipeline", "demos"}}
PREP_ALLOWED = {name: below | {name} for name, below in PREP_BELOW.items()}
PREP_ALLOWED["cli"] = {"commands", "plumbing"}
MAX_LINES = 500
REGISTRY = ROOT / PKG / "frame" / "families.py"
# Family facts as they are written: the hub processors' bounds (65,536 and 4,096, also cache sizes, are left out), LF's
# defaults for the frame keys (32*32, 768*768, 16*16, 256*256), transformers 4.x's processor defaults (56*56) and a
# resize factor given as a number (named, positional in a policy, or dividing a side). Budgets written in factor units
# (``1280*28*28``) are a user's choice of bounds, not a fact of the family.
FAMILY_FACTS = re.compile(r"\b(?:3,?136|12,?845,?056|16,?777,?216|25,?165,?824|589,?824)\b"
                          r"|\b(32|768|16|256|56) ?\* ?\1\b"
                          r"|factor\w*\s*(?::\s*int\s*)?=[^=\n]*\b(?:28|32)\b"
                          r"|Policy\([^()]*,\s*(?:28|32)\s*[,)]|//\s*(?:28|32)\b"
                          # the merge and temporal patch sizes, a patch side, a family's inner model class, LF's
                          # video defaults
                          r"|\b\w*(?:merge|MERGE|temporal_patch|TEMPORAL_PATCH)\w*\s*=\s*2\b"
                          r"|spatial_merge_size[\"']?\s*,\s*2\b|patch_size\s*=\s*1[46]\b|[\"']Qwen\w*Model[\"']"
                          r"|(?:fps|maxlen)\w*\s*:\s*\w+\s*=\s*(?:2\.0|128)\b")


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


def prep_area(module: str) -> str | None:
    """The part of qwenvl-prep a module belongs to: a sub-package, ``cli``, or None for the root (its version)."""
    parts = module.split(".")
    if parts[0] != PREP or len(parts) < 2 or not (parts[1] == "cli" or (PREP_ROOT / parts[1]).is_dir()):
        return None
    return parts[1]


MODULES = {module_name(p): imports(p) for p in [*(ROOT / PKG).rglob("*.py"), *(ROOT / "preprocessing").rglob("*.py")]}


def test_the_rules_see_the_imports():
    """Not vacuous: the known edges are found, and every sub-package has a rule."""
    assert f"{PKG}.integration.lf_compat" in MODULES[f"{PKG}.integration.grpo_workflow"]
    assert f"{PKG}.grpo.algorithm.advantages.estimator" in MODULES[f"{PKG}.grpo.trainer.rollout_phase"]
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


def grpo_part(module: str) -> str | None:
    """The part of the GRPO stage a module belongs to (None for ``grpo`` itself and ``grpo.args``)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == [PKG, "grpo"] and len(parts) > 2 and parts[2] in GRPO_ORDER else None


def test_grpo_reads_by_role():
    """One level of folders, the algorithm's parts; nothing else at its top but the package and its YAML keys."""
    grpo = ROOT / PKG / "grpo"
    assert {p.name for p in grpo.iterdir() if (p / "__init__.py").exists()} == set(GRPO_ORDER)
    assert {p.name for p in grpo.glob("*.py")} == {"__init__.py", "args.py"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if grpo_part(m)))
def test_grpo_parts_import_in_order(module):
    source = GRPO_ORDER.index(grpo_part(module))
    for target in sorted(MODULES[module]):
        into = grpo_part(target)
        if into is not None:
            assert GRPO_ORDER.index(into) <= source, f"{module} ({grpo_part(module)}) imports {target} ({into})"
        assert resolved(target) != f"{PKG}.grpo.args", f"{module} imports the YAML keys ({target})"


def test_every_sub_package_says_what_it_may_import():
    grpo_parts = (ROOT / PKG / "grpo" / name for name in GRPO_ORDER)
    for folder in [*(ROOT / PKG / name for name in ALLOWED), *grpo_parts, *(PREP_ROOT / name for name in PREP_BELOW)]:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        assert "May import" in doc, folder


def test_qwenvl_prep_shows_its_parts():
    """Its top level is the CLI and the sub-packages, each with a rule; nothing else to guess a place from."""
    assert {p.name for p in PREP_ROOT.iterdir() if (p / "__init__.py").exists()} == set(PREP_BELOW)
    assert {p.name for p in PREP_ROOT.glob("*.py")} == {"__init__.py", "cli.py"}
    assert f"{PREP}.commands.COMMANDS" in MODULES[f"{PREP}.cli"]  # the rules below see the tool's imports
    assert f"{PREP}.pipeline.convert.ConvertOptions" in MODULES[f"{PREP}.commands.convert"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if prep_area(m)))
def test_qwenvl_prep_import_directions(module):
    source = prep_area(module)
    for target in sorted(MODULES[module]):
        into = prep_area(target)
        if into is None or target.startswith(f"{PKG}."):
            continue
        assert into in PREP_ALLOWED[source], f"{module} ({source}) imports {target} ({into})"


def test_no_module_must_be_scrolled():
    long = {str(p.relative_to(ROOT)): n for p in [*(ROOT / PKG).rglob("*.py"), *PREP_ROOT.rglob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def resolved(target: str) -> str | None:
    """The module an imported name lives in (``pkg.frame.policy.ResizePolicy`` -> ``pkg.frame.policy``)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def test_no_import_cycles():
    """Among the package's and qwenvl-prep's modules (the two demos used to import each other)."""
    graph = {m: {t for t in map(resolved, targets) if t and t != m} for m, targets in MODULES.items()}
    assert "qwenvl_prep.demos.steps" in graph["qwenvl_prep.demos.fields"]  # qwenvl-prep's own imports are seen
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


def test_the_cli_starts_without_torch():
    """`qwenvl-prep --help`, convert and check answer at once: nothing torch-heavy is imported when the CLI loads
    (a top-level import of the GRPO rollout helpers made every command pay torch's 2-4 s start)."""
    import subprocess
    import sys

    code = "import sys, qwenvl_prep.cli; print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert found == "[]"


def test_family_facts_live_only_in_the_registry():
    """The factor, the merge and temporal patch sizes, the hub processors' bounds, the inner models whose positions
    are pinned and LF's frame-key defaults are written once, in ``frame/families.py``; every other module, benchmark,
    script and figure asks it (a copy in ``frame/policy.py`` gave every family Qwen2.5-VL's bounds in ``check``)."""
    registry = REGISTRY.read_text()
    for fact in ("12845056", "MERGE_SIZE = 2", "TEMPORAL_PATCH = 2", '"Qwen2VLModel"', "768 * 768"):
        assert FAMILY_FACTS.search(fact) and fact in registry  # the pattern finds what the registry writes
    modules = [*(ROOT / PKG).rglob("*.py"), *PREP_ROOT.rglob("*.py"),
               *(path for folder in ("benchmarks", "scripts", "docs/figures") for path in (ROOT / folder).rglob("*.py"))]
    outside = {str(p.relative_to(ROOT)): m.group(0) for p in modules
               if p != REGISTRY and (m := FAMILY_FACTS.search(p.read_text()))}
    assert not outside, f"family facts outside {REGISTRY.relative_to(ROOT)}: {outside}"
