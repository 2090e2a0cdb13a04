#!/usr/bin/env python3
"""Rewrite the generated regions of README.md and the docs, so that nothing is kept equal by hand.

    python scripts/sync_docs.py           rewrite every stale region
    python scripts/sync_docs.py --check   write nothing; exit 1 naming each stale region (tests/test_docs.py)

A region is the text between ``<!-- generated: NAME ... -->`` and ``<!-- end generated -->``. NAME is:

- ``families``: the model-families table (README.md, docs/training.md), from the registry
  (``llamafactory_qwenvl_patch/frame/families.py``: ``FAMILIES``) and, for the columns the registry does not hold,
  the prose in ``docs/families.toml``;
- any other name: the docs' region ``<!-- shared: NAME ... -->`` ... ``<!-- end shared -->`` (exactly one, in a page
  under docs/), copied with its relative links rebased for the file it lands in (README.md's quick start, what the
  plugin fixes, which environment).

Edit the registry, docs/families.toml or the shared region in docs/, then run this script.
"""

from __future__ import annotations

import argparse
import posixpath
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PROSE = DOCS / "families.toml"
TARGETS = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
COMMAND = "python scripts/sync_docs.py"

REGION = re.compile(r"^(<!-- generated: ([\w-]+)[^\n]*-->\n)(.*?)^(<!-- end generated -->)$", re.DOTALL | re.MULTILINE)
SHARED = re.compile(r"^<!-- shared: ([\w-]+)[^\n]*-->\n(.*?)^<!-- end shared -->$", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
COORDS = {"model": "absolute pixels of the model input", "rel1000": "relative 0-1000"}
HEADER = ("| family | factor (patch x merge) | answers in | `model_type`s recognised | LF templates | "
          "first transformers | tested readers that serve it | videos in the frame |")


def _registry():
    sys.path.insert(0, str(ROOT))  # this checkout's package, whatever an editable install points at
    from llamafactory_qwenvl_patch.frame import families

    return families


def _names(names) -> str:
    return ", ".join(f"`{name}`" for name in names)


def families_table() -> str:
    """The families table: every registered family in registration order; the readers and videos columns (and the
    model types and templates the registry recognises by prefix only) from docs/families.toml."""
    families = _registry()
    prose = tomllib.loads(PROSE.read_text())
    unknown = sorted(set(prose) - set(families.FAMILIES))
    if unknown:
        raise SystemExit(f"{PROSE.relative_to(ROOT)} describes families the registry does not have: {unknown}")
    rows = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for name, family in families.FAMILIES.items():
        if name not in prose:
            raise SystemExit(f"{PROSE.relative_to(ROOT)} has no [{name}]: add its readers and videos, then run "
                             f"{COMMAND}")
        entry = prose[name]
        for key in ("also_model_types", "also_templates"):
            claimed = (families.family_of_model_type if key == "also_model_types" else families.family_for_template)
            wrong = [value for value in entry.get(key, []) if claimed(value) != name]
            if wrong:
                raise SystemExit(f"{PROSE.relative_to(ROOT)} [{name}] {key}: {wrong} do not resolve to {name} in the "
                                 "registry")
        patch, merge = family.factor // families.MERGE_SIZE, families.MERGE_SIZE
        model_types = sorted({*family.model_types, *entry.get("also_model_types", [])})
        templates = sorted({*family.templates, *entry.get("also_templates", [])})
        template_cell = _names(templates) if templates else f"(`{family.default_template}`, decided by the checkpoint)"
        cells = [f"`{name}`", f"{family.factor} ({patch} x {merge})", COORDS[family.coords], _names(model_types),
                 template_cell, family.since_transformers, entry["readers"], entry["videos"]]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def shared_regions() -> dict[str, tuple[Path, str]]:
    found: dict[str, tuple[Path, str]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for match in SHARED.finditer(page.read_text()):
            name = match.group(1)
            if name in found:
                raise SystemExit(f"shared region {name!r} is in {found[name][0].relative_to(ROOT)} and "
                                 f"{page.relative_to(ROOT)}: keep one")
            found[name] = (page, match.group(2))
    return found


def rebase(text: str, source: Path, target: Path) -> str:
    """``text`` from ``source`` with its relative links pointing at the same files from ``target``."""
    if source == target:
        return text

    def one(match: re.Match) -> str:
        link = match.group(2)
        if re.match(r"[a-z]+:|/", link):
            return match.group(0)
        path, hash_, anchor = link.partition("#")
        absolute = source if not path else source.parent / path
        moved = posixpath.relpath(absolute.as_posix(), target.parent.as_posix())
        return f"{match.group(1)}{moved}{hash_}{anchor}{match.group(3)}"

    return LINK.sub(one, text)


def render(target: Path, text: str, shared: dict[str, tuple[Path, str]], table: str) -> tuple[str, list[str]]:
    """``text`` with every generated region rewritten, and the names of those that changed."""
    changed: list[str] = []

    def one(match: re.Match) -> str:
        name = match.group(2)
        if name == "families":
            body = table
        elif name in shared:
            body = rebase(shared[name][1], shared[name][0], target)
        else:
            raise SystemExit(f"{target.relative_to(ROOT)}: generated region {name!r} has no source (a "
                             f"'<!-- shared: {name} -->' region in docs/, or 'families')")
        if body != match.group(3):
            changed.append(name)
        return match.group(1) + body + match.group(4)

    return REGION.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a region is stale")
    args = parser.parse_args(argv)
    shared, table = shared_regions(), families_table()
    stale = []
    for target in TARGETS:
        text = target.read_text()
        new, changed = render(target, text, shared, table)
        if changed:
            stale += [f"{target.relative_to(ROOT)}: {name}" for name in changed]
            if not args.check:
                target.write_text(new)
    if stale and args.check:
        print("stale generated regions (edit the source, not the copy):\n  " + "\n  ".join(stale)
              + f"\nrun: {COMMAND}", file=sys.stderr)
        return 1
    for line in stale:
        print(f"rewrote {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
