#!/usr/bin/env bash
# The H200 benchmark call: re-check the paths fixed after the last suite run, then the data-movement
# benchmark, the standard configurations with the peers (three groups, each with its own time limit so a
# slow group cannot lose the others' results), and the demo if time is left.  Everything lands in $OUT.
set -u
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
START=$(date +%s)
left() { echo $(( ${BUDGET:-585} - ($(date +%s) - START) )); }
source tools/peers_env.sh
# a) re-checks, in parallel (correctness only)
( timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_movement_gpu.py -k "nvfp4 or fp16" > $OUT/r_movement.log 2>&1; echo rc=$? >> $OUT/r_movement.log ) &
( timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py -k "nvfp4" > $OUT/r_attention.log 2>&1; echo rc=$? >> $OUT/r_attention.log ) &
( timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_layer_gpu.py tests/gpu/test_cli_gpu.py tests/gpu/test_runner_gpu.py -rs > $OUT/r_system.log 2>&1; echo rc=$? >> $OUT/r_system.log ) &
wait
for f in $OUT/r_*.log; do echo "== $f"; grep -E "passed|failed|rc=" $f | tail -2; done
# b) timings, one at a time
timeout 90 python3 benchmarks/bench_movement.py --out $OUT/movement.json --reps 30 > $OUT/movement.txt 2>&1; echo "movement rc=$?"
B="python3 -m sparsemla.cli bench --no-progress --reps 30"
timeout $(( $(left) > 170 ? 170 : $(left) )) $B --configs D-h16,D-h32,D-h64,D-h128 --out $OUT/b1 > $OUT/b1.txt 2>&1; echo "b1 rc=$?"
timeout $(( $(left) > 100 ? 100 : $(left) )) $B --configs D-h128-mtp,D-small,D-k --backends triton,flashmla,flashinfer --out $OUT/b2 > $OUT/b2.txt 2>&1; echo "b2 rc=$?"
timeout $(( $(left) > 100 ? 100 : $(left) )) $B --configs P-32k,P-h16,W --backends triton,flashmla --out $OUT/b3 > $OUT/b3.txt 2>&1; echo "b3 rc=$?"
if [ $(left) -gt 60 ]; then timeout $(( $(left) - 5 )) python3 -m sparsemla.cli demo --no-progress --requests 32 --json $OUT/demo.json > $OUT/demo.txt 2>&1; echo "demo rc=$?"; fi
echo "elapsed $(( $(date +%s) - START )) s"
