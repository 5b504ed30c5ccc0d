#!/usr/bin/env bash
# Eleventh session, call 1: the FP8-arithmetic mode's error (test cases) and speed against the default path.
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
timeout 200 python3 tools/exp/s11_f8_err.py > $OUT/err.jsonl 2> $OUT/err.stderr
timeout 320 python3 tools/exp/s11_f8.py --formats fp8_ds_mla,fp8 --configs 128x16,128x32,1x16,1x128,4x128,16x128,128x64 \
    --rounds 2 --out $OUT/f8.json > $OUT/f8.log 2> $OUT/f8.stderr
tail -5 $OUT/err.stderr $OUT/f8.stderr; grep "##" $OUT/f8.log
