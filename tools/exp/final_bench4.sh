#!/usr/bin/env bash
# Fourth session's benchmark call (after tools/gpu_suite.sh): data movement (NVFP4 write: 32-bit word
# stores, convert path by default) and D-small with the b = 1 split plan, peers side by side.
export OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
source tools/peers_env.sh
timeout 150 python3 benchmarks/bench_movement.py --out $OUT/movement.json --reps 30 > $OUT/movement.txt 2>&1; echo "movement rc=$?"
timeout 300 python3 benchmarks/peer_kernels.py --batches 1,4,16 --heads 16,128 --graph --out $OUT/small.json > $OUT/small.txt 2>&1; echo "small rc=$?"
tail -40 $OUT/movement.txt; tail -60 $OUT/small.txt
