#!/usr/bin/env bash
# Seventh session, first H200 call: the few-heads kernel with 2 and 3 consumer warpgroups (64-wide QK chunks,
# per-group PV pipelining): GPU tests for both, memcheck (3 consumers), then the kernel timings.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
run() { name=$1; shift; ( timeout 400 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_ds python3 -m pytest -q -x -m gpu tests/gpu/test_ws_few_gpu.py -k "fp8_ds_mla"
run t_fp8 python3 -m pytest -q -x -m gpu tests/gpu/test_ws_few_gpu.py -k "not fp8_ds_mla"
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|Error|error|rc=|ERROR SUMMARY" "$f" | tail -4; done
timeout 200 python3 benchmarks/few_sweep.py --formats fp8_ds_mla,fp8 --heads 16,32 --consumers 2,3 --splits 0 --no-triton --out $OUT/sweep1.json 2>&1 | grep -v Warn
