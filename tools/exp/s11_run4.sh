#!/usr/bin/env bash
# Eleventh session, call 4: `sparsemla bench` (runner path, CUDA graphs, peers in the same process) for the decode
# configurations where the FP8-arithmetic mode applies, and table 2 again after the tenth session's dispatch.
set -u
START=$(date +%s)
source tools/peers_env.sh
B="python3 -m sparsemla.cli bench --no-progress --reps 30"
timeout 270 $B --configs D-h16,D-h32,D-small* --formats fp8,fp8_ds_mla --backends triton,triton-fp8,flashmla,flashinfer \
  --out $OUT/b1 > $OUT/b1.txt 2>&1; echo "b1 rc=$? $(( $(date +%s) - START ))s"
timeout 250 $B --configs D-h64,D-h128,D-small* --formats bf16,nvfp4_ds_mla,fp8_ds_mla --backends triton,flashmla,flashinfer \
  --out $OUT/b2 > $OUT/b2.txt 2>&1; echo "b2 rc=$? $(( $(date +%s) - START ))s"
cd $OUT && tar czf bench.tgz b1 b2 && rm -rf b1 b2
tail -30 $OUT/b1.txt; tail -30 $OUT/b2.txt
