#!/usr/bin/env bash
# CI fragment: the vLLM plugin's tests (tests/test_vllm_plugin.py) in a venv of their own, because vLLM 0.33.0
# pins torch 2.14 and with it Triton 3.8.  No GPU: vLLM runs on its CPU platform and every Triton kernel (vLLM's
# top-k conversion, sparsemla's attention) under the interpreter.  Nothing is cached between runs.
# tests/test_vllm_contract.py imports no vLLM: the CPU suites run it on every release, Triton 3.8 included.
#
# Usage (from .ci/run):  scripts/ci_vllm.sh [VENV_DIR]
#   VENV_DIR defaults to a fresh temporary directory, removed at the end.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
if [ $# -ge 1 ]; then
    venv=$1
else
    venv=$(mktemp -d "${TMPDIR:-/tmp}/sparsemla-vllm.XXXXXX")
    trap 'rm -rf "$venv"' EXIT
fi

t0=$(date +%s)
df -h "$(dirname "$venv")" | tail -n 1
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --no-cache-dir --no-compile "vllm==0.33.0" -e "$root[vllm,test]"
t1=$(date +%s)

cd "$root"
# vLLM must really be there: the test module skips without it, which must not pass as green here.
"$venv/bin/python" -c "import vllm, sys; sys.exit(0 if vllm.__version__ == '0.33.0' else 1)"
CUDA_VISIBLE_DEVICES= VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_plugin.py
t2=$(date +%s)
echo "ci_vllm.sh: install $((t1 - t0)) s, tests $((t2 - t1)) s"
