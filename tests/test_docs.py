"""The front door and the docs site (issue 34): README.md stays short and agrees with the docs where it repeats them,
the site builds with ``mkdocs build --strict`` (reference pages generated from the code), and every shell or YAML
block is either run or checked by a test, or says why it is not run."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
SHELL_OR_YAML = {"bash", "sh", "shell", "console", "yaml", "yml"}
WORKED = ("<!-- worked-example: start -->", "<!-- worked-example: end -->")  # run by tests/test_readme_example.py
MARKER = re.compile(r"^<!-- (tested|not run): (.{10,}) -->$")


def fenced_blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, the line before the fence, body) of each fenced block outside the worked example."""
    text = path.read_text()
    start, end = (text.find(marker) for marker in WORKED)
    blocks = []
    for match in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        if start != -1 and start < match.start() < end:
            continue
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1), before, match.group(2)))
    return blocks


def table(text: str, header: str) -> str:
    """The markdown table whose first line starts with ``header``."""
    start = text.index(header)
    return text[start:text.find("\n\n", start)]


def test_the_readme_is_a_front_door():
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail into docs/"
    for link in re.findall(r"\]\((docs/[^)#]+)", README.read_text()):
        assert (ROOT / link).is_file(), link


def test_what_the_readme_repeats_agrees_with_the_docs():
    """The drift table, the families table and the two commands appear in README.md and in the docs; they must not
    drift apart. The test command is .ci/run's, verbatim."""
    readme = README.read_text()
    pairs = [("| images | mismatched |", DOCS / "index.md"), ("| family | factor", DOCS / "training.md")]
    for header, page in pairs:
        assert table(readme, header) == table(page.read_text(), header), (header, page.name)
    commands = [body for _, lang, _, body in fenced_blocks(README) if lang == "bash"]
    started = [body for _, lang, _, body in fenced_blocks(DOCS / "getting-started.md") if lang == "bash"]
    assert commands[:2] == started[:2]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1].strip() in ci.splitlines()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_and_yaml_block_is_run_or_says_why_not(page):
    """A block is run or checked by a test (``<!-- tested: tests/... -->`` naming a test file that reads this page
    or says what it runs), or marked ``<!-- not run: reason -->``, on the line before its fence."""
    for line, lang, before, _ in fenced_blocks(page):
        if lang not in SHELL_OR_YAML:
            continue
        marker = MARKER.match(before)
        assert marker, f"{page.name}:{line}: a {lang} block without a 'tested:' or 'not run:' marker"
        if marker.group(1) == "tested":
            named = re.findall(r"(tests/\w+\.py|\.ci/run)", marker.group(2))
            assert named and all((ROOT / path).is_file() for path in named), f"{page.name}:{line}: {before}"


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: no broken link, no page outside the nav; the reference pages generated from the
    parsers and the argument dataclasses, every subcommand and every plugin key among them."""
    pytest.importorskip("mkdocs", reason="the docs requirements (docs/requirements.txt) are not installed")
    pytest.importorskip("material", reason="the docs requirements (docs/requirements.txt) are not installed")
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                            capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", **os.environ})
    assert result.returncode == 0, result.stderr[-4000:]
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("convert", "check", "draw", "predict", "eval", "fix-config", "demo", "tiny-model"):
        assert f"qwenvl-prep {command}" in cli, command
    keys = (site / "reference" / "yaml-keys" / "index.html").read_text()
    from llamafactory.hparams import FinetuningArguments

    from llamafactory_qwenvl_patch.grpo.args import extend_finetuning_arguments

    base = {field.name for field in dataclasses.fields(FinetuningArguments)}
    added = [f.name for f in dataclasses.fields(extend_finetuning_arguments(FinetuningArguments)) if f.name not in base]
    assert len(added) > 20
    for key in ["qwenvl_patch", "qwenvl_answer_coords", *added]:
        assert f"<code>{key}</code>" in keys, key
