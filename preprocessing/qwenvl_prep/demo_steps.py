"""What every demo does between its own steps: run one step as its own process (as a user would) and write its
inputs. The demos (``demo`` for grounding, ``demo_fields`` for invoices) import this and never each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_step(step: str, args: list[str], log_dir: Path) -> None:
    """Run one step as its own process (as a user would), logging to a file; fail with the log's tail."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
           "DISABLE_VERSION_CHECK": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = log_dir / f"{step}.log"
    print(f"[demo {time.strftime('%H:%M:%S')}] {step}: {' '.join(args)} (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        code = subprocess.run([str(bin_dir / args[0]), *args[1:]], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"demo step {step} failed (exit {code}); end of {log}:\n{tail}")


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
