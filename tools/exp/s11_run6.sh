#!/usr/bin/env bash
# Eleventh session, call 6: the F8 variant with q's two terms as one N = 32 MMA (half the QK MMAs): its tests,
# memcheck of its kernels, and the same-process speed A/B against the default path.
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
( timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_fp8_arith_gpu.py > $OUT/t_f8.log 2>&1; echo "rc=$?" >> $OUT/t_f8.log ) &
( PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 tests/gpu/sanitize_kernels.py fp8_arith > $OUT/t_san.log 2>&1; echo "rc=$?" >> $OUT/t_san.log ) &
wait
timeout 200 python3 tools/exp/s11_f8.py --formats fp8_ds_mla,fp8 --configs 128x16,128x32,1x16,1x128,4x128,16x128 \
    --rounds 2 --out $OUT/f8.json > $OUT/f8.log 2> $OUT/f8.stderr
tail -n 3 $OUT/t_f8.log $OUT/t_san.log; grep -E "^FAILED" $OUT/t_f8.log | head; tail -n 3 $OUT/f8.stderr; grep "##" $OUT/f8.log
