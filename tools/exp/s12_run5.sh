#!/usr/bin/env bash
# Twelfth session, call 5: D-h16 / D-h64 / D-h128 (b 128) with the peers in the same process, our default path and
# the FP8-arithmetic mode (now with ws_wide's F8 variant at 64 / 128 heads), fp8_ds_mla / fp8 / bf16.
set -u
source tools/peers_env.sh > /dev/null 2>&1
timeout 330 python3 benchmarks/peer_kernels.py --heads 16,64,128 --graph --fp8-arith --formats fp8_ds_mla,fp8,bf16 \
  --out $OUT/peers.json 2>&1 | grep -E "b=|ceil|Error"
