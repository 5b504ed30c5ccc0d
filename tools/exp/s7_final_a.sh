#!/usr/bin/env bash
# Seventh session, final H200 call A: the GPU tests touched by this session's changes (few-heads kernel for
# every quantized kind incl. NVFP4, the attention suite, runner / layer) and the memcheck run, in parallel.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
run() { name=$1; shift; ( timeout 420 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_few python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py
run t_sys python3 -m pytest -q -m gpu tests/gpu/test_runner_gpu.py tests/gpu/test_layer_gpu.py -rs
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|Error|error|rc=|ERROR SUMMARY" "$f" | tail -4; done
grep -E "^FAILED|Assertion" "$OUT"/t_*.log | head -20
