#!/usr/bin/env bash
# Fourth session, first H200 call: (1) the data-movement GPU suite with the aligned NVFP4 write now the
# default, (2) bench_movement's cache-write timings (no_hint = the old default), (3) Nsight Compute on the
# few-heads kernels at D-h16 (fp8_ds_mla, fp8, bf16): details + per-SASS stall samples.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
N=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
( timeout 400 python3 -m pytest -q -m gpu tests/gpu/test_movement_gpu.py > $OUT/t_movement.log 2>&1; echo rc=$? >> $OUT/t_movement.log ) &
( timeout 300 python3 benchmarks/bench_movement.py --only write --out $OUT/write.json > $OUT/write.log 2>&1; echo rc=$? >> $OUT/write.log ) 
for f in fp8_ds_mla fp8 bf16; do
  timeout 200 $N --clock-control none -k regex:_fwd_ -c 1 --set full --import-source no -o /tmp/prof_$f python3 benchmarks/profile_one.py --fmt $f --heads 16 > /tmp/ncu_$f.log 2>&1
  $N --import /tmp/prof_$f.ncu-rep --page details --print-details all > /tmp/prof_${f}_details.txt 2>&1
  $N --import /tmp/prof_$f.ncu-rep --page source --csv --print-source sass > /tmp/prof_${f}_sass.csv 2>&1
done
wait
cd /tmp && tar czf $OUT/prof.tgz prof_*_details.txt prof_*_sass.csv ncu_*.log
tail -5 $OUT/t_movement.log; tail -30 $OUT/write.log
for f in fp8_ds_mla fp8 bf16; do echo "== $f"; grep -E "Duration|DRAM Throughput|Warp Cycles Per Issued|Issue Slots Busy|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit" /tmp/prof_${f}_details.txt | head -14; done
