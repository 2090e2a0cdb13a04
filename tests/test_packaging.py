"""A regular (non-editable) wheel ships the ``.pth`` hook at the site-packages root and both packages."""

from __future__ import annotations

import subprocess
import sys
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
    probe = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    found, location = probe.stdout.split()
    assert found == "True" and location.startswith(str(target))
