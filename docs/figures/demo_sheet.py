"""docs/figures/demo-contact-sheet.jpg: the default grounding demo's contact sheet (held-out photos with the true box
and the trained model's answer mapped back into each photo's pixels), copied from a fresh demo run::

    .venv/bin/python docs/figures/demo_sheet.py      # runs `qwenvl-prep demo` (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().with_name("demo-contact-sheet.jpg")


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        run = Path(scratch) / "demo"
        subprocess.run([str(Path(sys.executable).with_name("qwenvl-prep")), "demo", str(run)], check=True)
        sheets = sorted(run.rglob("*contact-sheet*.jpg"))
        if not sheets:
            raise SystemExit(f"the demo in {run} wrote no contact sheet")
        shutil.copyfile(sheets[-1], OUT)
        print(OUT, "from", sheets[-1].relative_to(run))


if __name__ == "__main__":
    main()
