#!/bin/bash
# Tenth session, call 1: quantized rows above 32 heads at small and medium batches, current dispatch vs ws_few
# in 16-head groups vs ws_wide (tools/exp/s10_small.py); then ws_few's split count at b 1.
set -x
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 420 python3 tools/exp/s10_small.py --batches 1,2,4,8,16,32,64 --out $OUT/small.json 2>&1 | tail -n 200
timeout 120 python3 tools/exp/s10_small.py --batches 1,4 --heads 128 --modes default,few --few-splits 0,4,8,32 \
  --out $OUT/small-splits.json 2>&1 | tail -n 60
