#!/usr/bin/env bash
# The decode kernels' GPU tests in parallel groups on the H200 (compiles dominate), logs in $OUT/t_*.log, then a
# summary: ws_wide, ws_few + the bf16 ws kernels, the attention suite, compute-sanitizer memcheck, and with
# "system" also the runner / layer / CLI tests.  Usage (repository root, PYTHONPATH set, e.g. by
# tools/peers_env.sh): bash tools/exp/kernel_tests.sh TIMEOUT_S [system]
set -u
T=$1
run() { name=$1; shift; ( timeout "$T" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_wide python3 -m pytest -q -m gpu tests/gpu/test_ws_wide_gpu.py
run t_few python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py tests/gpu/test_ws_attention_gpu.py tests/gpu/test_fp8_arith_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py
if [ "${2:-}" = system ]; then
  run t_rlc python3 -m pytest -q -m gpu tests/gpu/test_runner_gpu.py tests/gpu/test_layer_gpu.py tests/gpu/test_cli_gpu.py
fi
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|rc=|ERROR SUMMARY" "$f" | tail -3; done
grep -E "^FAILED|Error:|Assertion" "$OUT"/t_*.log | head -20
