#!/usr/bin/env bash
# Eleventh session, call 5: the FP8-arithmetic tests (lse tolerance fixed) and the runner / layer / CLI tests (timed
# out in call 4 beside four other groups), then `sparsemla bench` (runner path, CUDA graphs, peers in the same
# process) for the decode configurations where the FP8-arithmetic mode applies.
set -u
START=$(date +%s)
source tools/peers_env.sh
( timeout 290 python3 -m pytest -q -m gpu tests/gpu/test_fp8_arith_gpu.py > $OUT/t_f8.log 2>&1; echo "rc=$?" >> $OUT/t_f8.log ) &
( timeout 290 python3 -m pytest -q -m gpu tests/gpu/test_runner_gpu.py tests/gpu/test_layer_gpu.py tests/gpu/test_cli_gpu.py \
  > $OUT/t_rlc.log 2>&1; echo "rc=$?" >> $OUT/t_rlc.log ) &
wait
echo "tests $(( $(date +%s) - START ))s"
B="python3 -m sparsemla.cli bench --no-progress --reps 30"
timeout 230 $B --configs D-h16,D-h32,D-small* --formats fp8,fp8_ds_mla --backends triton,triton-fp8,flashmla,flashinfer \
  --out $OUT/b1 > $OUT/b1.txt 2>&1; echo "b1 rc=$? $(( $(date +%s) - START ))s"
cd $OUT && tar czf bench.tgz b1 && rm -rf b1
tail -n 4 $OUT/t_f8.log $OUT/t_rlc.log; grep -E "^FAILED" $OUT/t_*.log | head; tail -40 $OUT/b1.txt
