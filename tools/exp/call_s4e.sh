#!/usr/bin/env bash
# Fourth session: NVFP4 write storing 32-bit words (+ max.bf16x2 amax on the cvt path): GPU bytes check,
# write timings; D-small defaults with the new split plan.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_movement_gpu.py > $OUT/t_movement.log 2>&1; echo rc=$? >> $OUT/t_movement.log
timeout 200 python3 benchmarks/bench_movement.py --only write --sweep --formats nvfp4_ds_mla,nvfp4_ds_mla-nope,fp8_ds_mla --out $OUT/write_sweep.json > $OUT/write_sweep.log 2>&1; echo rc=$? >> $OUT/write_sweep.log
timeout 200 python3 benchmarks/small_sweep.py --default-only --batches 1,4,16 --out $OUT/small_default.json > $OUT/small_default.log 2>&1; echo rc=$? >> $OUT/small_default.log
tail -3 $OUT/t_movement.log; grep -E "nvfp4|fp8_ds_mla " $OUT/write_sweep.log | grep -v "^$"; cat $OUT/small_default.log
