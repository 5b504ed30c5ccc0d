#!/usr/bin/env bash
# Twelfth session, call 1: ws_wide's FP8-arithmetic variant -- A/B against the default at D-h64 / D-h128 (graph
# replay, same process, errors against float64), then its tests and a memcheck of the F8 kernels in parallel.
set -u
source tools/peers_env.sh
timeout 200 python3 tools/exp/s11_f8.py --formats fp8_ds_mla,fp8 --configs 128x64,128x128 --rounds 2 \
  --out $OUT/ab.json 2>&1 | grep -E "##|error"
t() { name=$1; shift; ( timeout 330 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
t t_wide python3 -m pytest -q -m gpu tests/gpu/test_fp8_arith_gpu.py -k "wide or far_apart or applies"
t t_few python3 -m pytest -q -m gpu tests/gpu/test_fp8_arith_gpu.py -k "not (wide or far_apart or applies)"
t t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py fp8_arith
wait
for f in $OUT/t_*.log; do grep -E "passed|failed|rc=|ERROR SUMMARY" $f | tail -3; done
grep -hE "^FAILED|Error|assert" $OUT/t_*.log | head -30
