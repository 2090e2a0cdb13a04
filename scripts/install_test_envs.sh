#!/usr/bin/env bash
# Install both tested sets, each in its own virtual environment:
#   .venv-tf457  constraints-tf457.txt: the test extras under transformers 4.57 (no vLLM)
#   .venv        constraints.txt: the test extras, the docs site's requirements, then vLLM 0.28 (scripts/add_vllm.sh)
# uv installs them (uv itself pinned in constraints.txt, put by pip into .venv-uv): from the same constraints it
# installs the same packages pip does (both sets compared name for name, 2026-12-06), in about 100 s for both where
# pip took 3 min 16 s side by side: it unpacks each wheel once into its cache and links from there. The environments
# are made by venv, so each still has its own pip. The .pyc files are compiled at install on purpose
# (UV_COMPILE_BYTECODE): CI sets PYTHONDONTWRITEBYTECODE=1, so without them every process would compile torch,
# transformers and LF from source again (measured 2026-12-06: the suite's CLI smoke runs took about twice as long).
# One set after the other: side by side they took longer (116 s), both compiling on both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-uv
.venv-uv/bin/pip install -q -c constraints.txt uv
export UV="$PWD/.venv-uv/bin/uv" UV_COMPILE_BYTECODE=1
python3 -m venv .venv-tf457
"$UV" pip install -q --python .venv-tf457/bin/python -c constraints-tf457.txt -e ".[test]"
python3 -m venv .venv
"$UV" pip install --python .venv/bin/python -c constraints.txt -e ".[test]" -r docs/requirements.txt
scripts/add_vllm.sh .venv
