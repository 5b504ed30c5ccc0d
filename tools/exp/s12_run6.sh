#!/usr/bin/env bash
# Twelfth session, call 6: the rest of the decode table at the session's final code -- nvfp4 and the NoPE formats at
# D-h16 / D-h64 / D-h128, and D-small (b 1 / 4 / 16 at 16 and 128 heads) with the FP8-arithmetic mode.
set -u
source tools/peers_env.sh > /dev/null 2>&1
timeout 150 python3 benchmarks/peer_kernels.py --heads 16,64,128 --graph \
  --formats nvfp4_ds_mla,fp8_ds_mla-nope,fp8-nope,bf16-nope,nvfp4_ds_mla-nope --out $OUT/peers_rest.json 2>&1 | grep -E "b=|ceil|Error"
timeout 130 python3 benchmarks/peer_kernels.py --batches 1,4,16 --heads 16,128 --graph --fp8-arith \
  --formats fp8_ds_mla,fp8,bf16,nvfp4_ds_mla --out $OUT/small.json 2>&1 | grep -E "b=|ceil|Error"
