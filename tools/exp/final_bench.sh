#!/usr/bin/env bash
# Third session's benchmark call: decode kernel-only with peers (b 128; small batches with graph replay),
# prefill through the runner, data movement, and the dense-shortcut room check.  Results in $OUT.
set -u
START=$(date +%s)
source tools/peers_env.sh
timeout 200 python3 benchmarks/peer_kernels.py --heads 16,64,128 --out $OUT/peers.json > $OUT/peers.txt 2>&1; echo "peers rc=$? $(( $(date +%s) - START ))s"
timeout 120 python3 benchmarks/peer_kernels.py --batches 1,4,16 --heads 16,128 --graph --out $OUT/small.json > $OUT/small.txt 2>&1; echo "small rc=$? $(( $(date +%s) - START ))s"
timeout 100 python3 benchmarks/prefill_runner.py --heads 128 16 --reps 5 --out $OUT/prefill.json > $OUT/prefill.txt 2>&1; echo "prefill rc=$? $(( $(date +%s) - START ))s"
timeout 90 python3 benchmarks/bench_movement.py --reps 30 --out $OUT/movement.json > $OUT/movement.txt 2>&1; echo "movement rc=$? $(( $(date +%s) - START ))s"
timeout 60 python3 benchmarks/decode_sweep.py --plan dense --out $OUT/dense.json > $OUT/dense.txt 2>&1; echo "dense rc=$? $(( $(date +%s) - START ))s"
cd $OUT && tar czf results.tgz *.json && rm -f *.json
