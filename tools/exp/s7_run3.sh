#!/usr/bin/env bash
# Seventh session, third H200 call: the few-heads kernel's shared-memory tile variant (fp8, nvfp4) against its
# register-operand variant: GPU tests of both, memcheck, then the timings side by side in one process.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
run() { name=$1; shift; ( timeout 400 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_fp4 python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py -k "nvfp4 or k_scale or dispatch"
run t_fp8 python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py -k "fp8 and not nvfp4"
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py -k "nvfp4 or fp8"
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|Error|error|rc=|ERROR SUMMARY" "$f" | tail -4; done
grep -E "^FAILED|Assertion" "$OUT"/t_*.log | head -20
timeout 220 python3 benchmarks/few_sweep.py --formats nvfp4_ds_mla,fp8,fp8_ds_mla,nvfp4_ds_mla-nope,fp8-nope --heads 16,32 --splits 0 --tile 1,0 --no-triton --out $OUT/sweep3.json 2>&1 | grep -v Warn
