#!/usr/bin/env bash
# Eighth session, first H200 call: the wide kernel for quantized rows (ws_wide.py) -- its GPU tests, then
# D-h64 / D-h128 against the Triton wide kernel and bf16 (ws_pair) in one process.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -x -m gpu tests/gpu/test_ws_wide_gpu.py > $OUT/t_wide.log 2>&1; echo "rc=$?" >> $OUT/t_wide.log
tail -30 $OUT/t_wide.log
timeout 200 python3 benchmarks/few_sweep.py --heads 64,128 --formats fp8_ds_mla,fp8,bf16 --splits 0 --reps 20 --out $OUT/wide1.json 2>&1 | tail -20
