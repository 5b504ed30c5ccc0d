#!/usr/bin/env bash
# Tenth session, last H200 call: the few-heads kernel in 16-head groups above 32 heads at small batches (the
# new dispatch, ws_attention.FEW_WAVES): the Gluon kernels' tests, the attention suite and memcheck in
# parallel, then table 1b (D-small, graph replay, peers in the same process) and D-h64 nvfp4.
set -u
source tools/peers_env.sh
bash tools/exp/kernel_tests.sh 260
timeout 150 python3 benchmarks/peer_kernels.py --batches 1,4,16 --heads 16,64,128 --graph \
  --formats fp8_ds_mla,fp8,nvfp4_ds_mla,bf16 --out $OUT/small.json 2>&1 | grep -E "b=|ceil"
timeout 60 python3 benchmarks/peer_kernels.py --heads 64 --formats nvfp4_ds_mla,bf16 --out $OUT/nvfp4-h64.json 2>&1 | grep -E "b=|ceil"
