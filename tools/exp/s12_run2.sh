#!/usr/bin/env bash
# Twelfth session, call 2: ws_wide's F8 variant for fp8_ds_mla -- one group in flight (v1, git@62bd07e; the calls imported the same file copied as tools/exp/ws_wide_s12v1.py) vs two
# halves of 32 heads in flight (v2, git@8dd41a4; run as the working tree of that commit) vs the default kernel; b 128 at 64 / 128 heads and one
# program per SM at 1 / 16 pairs; then the F8 tests (wide cases) and a memcheck of the F8 kernels.
set -u
source tools/peers_env.sh
V=sparsemla.kernels.ws_wide:0,git@62bd07e:1,git@8dd41a4:1
timeout 260 python3 tools/exp/s12_ab.py --versions $V --formats fp8_ds_mla,fp8 \
  --configs 128x64,128x128,132x64:128:1,132x64:2048:1 --out $OUT/ab2.json 2>&1 | grep -E "##|Error|error"
t() { name=$1; shift; ( timeout 300 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
t t_wide python3 -m pytest -q -m gpu tests/gpu/test_fp8_arith_gpu.py -k "wide or far_apart or applies"
t t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py fp8_arith
wait
for f in $OUT/t_*.log; do grep -E "passed|failed|rc=|ERROR SUMMARY" $f | tail -3; done
grep -hE "^FAILED|Error|assert" $OUT/t_*.log | head -30
