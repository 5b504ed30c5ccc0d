#!/usr/bin/env bash
# Fourth session: D-small launch shapes (benchmarks/small_sweep.py), compiled in parallel first.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for f in bf16 fp8 fp8_ds_mla nvfp4_ds_mla; do
  timeout 300 python3 benchmarks/small_sweep.py --formats $f --compile-only > $OUT/compile_$f.log 2>&1 &
done
wait
timeout 300 python3 benchmarks/small_sweep.py --out $OUT/small_sweep.json > $OUT/small_sweep.log 2>&1; echo rc=$? >> $OUT/small_sweep.log
cat $OUT/small_sweep.log; tail -3 $OUT/compile_*.log
