#!/usr/bin/env bash
# Eleventh session, call 7: table 1b again (D-small, CUDA-graph replay, peers in the same process) with the
# FP8-arithmetic mode, and D-h16 with FlashMLA / FlashInfer beside it.
set -u
source tools/peers_env.sh
timeout 140 python3 benchmarks/peer_kernels.py --batches 1,4,16 --heads 16,128 --graph --fp8-arith \
  --formats fp8_ds_mla,fp8 --out $OUT/small.json 2>&1 | grep -E "b=|ceil"
timeout 90 python3 benchmarks/peer_kernels.py --heads 16 --graph --fp8-arith --formats fp8_ds_mla,fp8,bf16 \
  --out $OUT/h16.json 2>&1 | grep -E "b=|ceil"
