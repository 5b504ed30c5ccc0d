#!/usr/bin/env bash
# Ninth session, last H200 call (ws_wide with the shared-memory epilogue and q staged by both warpgroups;
# ws_few with approximate reciprocals): the Gluon kernels' tests, the attention suite and memcheck in
# parallel, then D-h64 / D-h128 and D-h16 with the peers in the same process.
set -u
source tools/peers_env.sh
bash tools/exp/kernel_tests.sh 280
timeout 170 python3 benchmarks/peer_kernels.py --heads 64,128 --formats fp8_ds_mla,fp8,bf16 --out $OUT/peers-wide.json 2>&1 | grep -E "b=|ceil" > $OUT/peers.log
timeout 90 python3 benchmarks/peer_kernels.py --heads 16 --formats fp8_ds_mla,fp8,nvfp4_ds_mla --out $OUT/peers-h16.json 2>&1 | grep -E "b=|ceil" > $OUT/peers16.log
cat $OUT/peers.log $OUT/peers16.log
