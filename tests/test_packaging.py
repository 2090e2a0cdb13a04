"""A regular (non-editable) wheel ships the ``.pth`` hook at the site-packages root and both packages, and the
requirements admit the tested sets and refuse the releases known to be wrong."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_the_hook(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    wheel = next(tmp_path.glob("llamafactory_qwenvl_patch-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "llamafactory_qwenvl_patch.pth" in names
    assert "llamafactory_qwenvl_patch/frame/policy.py" in names and "qwenvl_prep/cli.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "qwenvl-prep = qwenvl_prep.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = (f"import site, sys; site.addsitedir({str(target)!r}); "
            "import llamafactory_qwenvl_patch as p; "
            "print(any(type(f).__name__ == 'PostImportFinder' for f in sys.meta_path), p.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the wheel's copy, not a checkout's
    probe = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert probe.returncode == 0, probe.stderr
    found, location = probe.stdout.split()
    assert found == "True" and location.startswith(str(target))


def requirement(name: str):
    from packaging.requirements import Requirement

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, dependencies) if r.name == name)


def test_transformers_releases_with_wrong_qwen2_positions_are_refused():
    """Issue 49, item 5: 5.3.0 to 5.5.3 give still images temporal position 2 x start (transformers#45325), 5.3.0 to
    5.5.4 give every video frame the same one (#45381). The tested sets (constraints*.txt) stay admitted."""
    specifier = requirement("transformers").specifier
    refused = ["5.3.0", "5.4.0", "5.5.0", "5.5.3", "5.5.4"]
    admitted = ["4.55.0", "4.56.2", "4.57.1", "4.57.6", "5.0.0", "5.1.0", "5.2.0", "5.6.0"]
    assert [v for v in refused if v in specifier] == []
    assert [v for v in admitted if v not in specifier] == []
    assert "5.6.2" not in specifier  # LF 0.9.5's ceiling is 5.6.0
    for constraints in ROOT.glob("constraints*.txt"):
        pinned = re.search(r"^transformers==(\S+)$", constraints.read_text(), re.MULTILINE).group(1)
        assert pinned in specifier, constraints.name
