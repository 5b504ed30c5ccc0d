#!/usr/bin/env bash
# The H200 test suite in one call: GPU tests in parallel groups (compiles dominate), the memcheck run and
# the accuracy report.  Logs go to $OUT.  Peers are used when their wheels were carried (.whl, .peers).
set -u
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if [ -f .peers/flashinfer_trim.tgz ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
  tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export PYTHONPATH=/tmp/site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws
fi
T=${SUITE_TIMEOUT:-420}
run() { name=$1; shift; ( timeout $T "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_movement python3 -m pytest -q -m gpu tests/gpu/test_movement_gpu.py
run t_attention python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py
run t_system python3 -m pytest -q -m gpu tests/gpu/test_runner_gpu.py tests/gpu/test_layer_gpu.py tests/gpu/test_cli_gpu.py tests/test_formats.py -rs
run t_sanitize env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
run accuracy python3 benchmarks/accuracy_report.py --out "$OUT/accuracy.json" --md "$OUT/accuracy.md" --prompt-len 8192
wait
for f in "$OUT"/t_*.log "$OUT"/accuracy.log; do echo "== $f"; grep -E "passed|failed|error|rc=|ERROR SUMMARY" "$f" | tail -4; done
