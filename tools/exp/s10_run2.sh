#!/usr/bin/env bash
# Tenth session, call 2: A/B of ws_few's lazy softmax (f753605 = exact max and units every block; ws_few = lazy
# max and group units, the units' band checked on the block's exact largest scale; ws_few_bits = the same with
# the scale band voted as row bits) at D-h16, the new small-batch dispatch against the Triton path, (the tests: s10_run3.sh).
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv
timeout 210 python3 tools/exp/s9_ab.py --few git:f753605,sparsemla.kernels.ws_few,sparsemla.kernels.ws_few_bits \
  --few-formats fp8_ds_mla,fp8,nvfp4_ds_mla --rounds 2 --out $OUT/ab.json 2>&1 | grep -v Warning
timeout 120 python3 tools/exp/s10_small.py --batches 1,4,16 --heads 64,128 --modes default,triton \
  --out $OUT/small.json 2>&1 | grep -v Warning
