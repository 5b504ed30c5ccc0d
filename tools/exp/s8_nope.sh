#!/usr/bin/env bash
# Eighth session: the NoPE layouts at 64 / 128 heads (fp8 kinds now on ws_wide), b 128, top-k 2048, with the
# bf16 NoPE rows (ws_pair) in the same process.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 150 python3 benchmarks/peer_kernels.py --heads 64,128 --formats fp8_ds_mla-nope,fp8-nope,bf16-nope --out $OUT/peers-wide-nope.json 2>&1 | grep -E "b=|ceil"
