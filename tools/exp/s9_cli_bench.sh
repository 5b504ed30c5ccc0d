#!/usr/bin/env bash
# Ninth session: `sparsemla bench` (runner path, table 2) for the decode configurations, after the ws_few /
# ws_wide kernels of sessions six to nine (table 2 was last run in the third session).
set -u
START=$(date +%s)
source tools/peers_env.sh
B="python3 -m sparsemla.cli bench --no-progress --reps 30 --backends triton,flashmla,flashinfer"
timeout 200 $B --configs D-h16,D-h32,D-h64,D-h128 --out $OUT/b1 > $OUT/b1.txt 2>&1; echo "b1 rc=$? $(( $(date +%s) - START ))s"
timeout 110 $B --configs D-h128-mtp,D-small*,D-k* --out $OUT/b2 > $OUT/b2.txt 2>&1; echo "b2 rc=$? $(( $(date +%s) - START ))s"
cd $OUT && tar czf bench.tgz b1 b2 && rm -rf b1 b2
tail -40 $OUT/b1.txt
