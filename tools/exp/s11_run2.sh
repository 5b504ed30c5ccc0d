#!/usr/bin/env bash
# Eleventh session, call 2: q as two e4m3 terms (hi + lo): error (test cases), the GPU tests, speed.
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 250 python3 -m pytest -q -m gpu tests/gpu/test_fp8_arith_gpu.py -x -q > $OUT/t_f8.log 2>&1 &
timeout 200 python3 tools/exp/s11_f8_err.py > $OUT/err.jsonl 2> $OUT/err.stderr
wait
timeout 300 python3 tools/exp/s11_f8.py --formats fp8_ds_mla,fp8 --configs 128x16,128x32,1x16,1x128,4x128,16x128 \
    --rounds 2 --out $OUT/f8.json > $OUT/f8.log 2> $OUT/f8.stderr
tail -n 5 $OUT/err.stderr $OUT/f8.stderr; tail -n 15 $OUT/t_f8.log; grep "##" $OUT/f8.log
