#!/usr/bin/env bash
# Tenth session, call 3: the Gluon kernels' tests, the attention suite and memcheck in parallel (ws_few's lazy
# softmax, the few-heads kernel's head groups above 32 heads at small batches).
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
run() { name=$1; shift; ( timeout 280 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_wide python3 -m pytest -q -m gpu tests/gpu/test_ws_wide_gpu.py
run t_few python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py tests/gpu/test_ws_attention_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|rc=|ERROR SUMMARY" "$f" | tail -3; done
grep -E "^FAILED|Error|assert" "$OUT"/t_*.log | head -20
