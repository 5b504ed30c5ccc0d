#!/usr/bin/env bash
# Twelfth session, call 3: ws_wide's F8 variant with the cheaper per-head q staging (exponent-bit scales, the
# two terms formed in fp16) against v1 (git@62bd07e, run as a copy of that file: log2 / exp2 / a division per head, terms via fp32)
# and the default kernel; then the whole FP8-arithmetic test file and a memcheck of the F8 kernels.
set -u
source tools/peers_env.sh
V=sparsemla.kernels.ws_wide:0,git@62bd07e:1,sparsemla.kernels.ws_wide:1
timeout 260 python3 tools/exp/s12_ab.py --versions $V --formats fp8_ds_mla,fp8 \
  --configs 128x64,128x128,132x64:128:1,132x64:2048:1 --out $OUT/ab3.json 2>&1 | grep -E "##|Error|error"
t() { name=$1; shift; ( timeout 300 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
t t_wide python3 -m pytest -q -m gpu tests/gpu/test_fp8_arith_gpu.py -k "wide or far_apart or applies"
t t_few python3 -m pytest -q -m gpu tests/gpu/test_fp8_arith_gpu.py -k "not (wide or far_apart or applies)"
t t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py fp8_arith
wait
for f in $OUT/t_*.log; do grep -E "passed|failed|rc=|ERROR SUMMARY" $f | tail -3; done
grep -hE "^FAILED|Error|assert" $OUT/t_*.log | head -30
