#!/usr/bin/env bash
# Fourth session, second H200 call: NVFP4 cache-write tilings (aligned read now the default), then the
# transposed few-heads kernel against the current ones (decode_sweep plan "narrow").
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 benchmarks/bench_movement.py --only write --sweep --formats nvfp4_ds_mla,nvfp4_ds_mla-nope --out $OUT/write_sweep.json > $OUT/write_sweep.log 2>&1; echo rc=$? >> $OUT/write_sweep.log
timeout 420 python3 benchmarks/decode_sweep.py --plan narrow --jobs 8 --out $OUT/narrow.json > $OUT/narrow.log 2>&1; echo rc=$? >> $OUT/narrow.log
grep -v "^$" $OUT/write_sweep.log | tail -40
cat $OUT/narrow.log | cut -c1-170
