#!/usr/bin/env bash
# Install both tested sets side by side, each in its own virtual environment, at the same time:
#   .venv        constraints.txt: the test extras, the docs site's requirements, then vLLM 0.28 (scripts/add_vllm.sh)
#   .venv-tf457  constraints-tf457.txt: the test extras under transformers 4.57 (no vLLM)
# Each install is mostly one core unpacking wheels (about 2.5 minutes each on 2 cores, measured 2026-12-05), so the
# two together take the time of the longer. The second's output goes to .venv-tf457/install.log, printed if it fails.
# pip compiles the .pyc files at install on purpose: CI sets PYTHONDONTWRITEBYTECODE=1, so with --no-compile every
# process would compile torch, transformers and LF from source again (measured 2026-12-06: the suite's CLI smoke runs
# took about twice as long, more than the 38 s per set --no-compile saves at install).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
python3 -m venv .venv-tf457
.venv-tf457/bin/pip install -q -c constraints-tf457.txt -e ".[test]" > .venv-tf457/install.log 2>&1 &
second=$!
status=0
{ .venv/bin/pip install -c constraints.txt -e ".[test]" -r docs/requirements.txt && scripts/add_vllm.sh .venv; } ||
    status=$?
if ! wait "$second"; then
    echo "installing .venv-tf457 (constraints-tf457.txt) failed; its log:" >&2
    cat .venv-tf457/install.log >&2
    exit 1
fi
exit "$status"
