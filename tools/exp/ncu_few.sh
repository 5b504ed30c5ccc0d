#!/usr/bin/env bash
# Nsight Compute on the warp-specialized few-heads kernel (D-h16, fp8_ds_mla): details + per-SASS stall
# samples into $OUT, then the few-heads sweep with the new split plan.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
N=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
timeout 200 $N --clock-control none -k regex:ws_few -c 1 --set full --import-source no -o $OUT/prof_few python3 benchmarks/profile_one.py --fmt fp8_ds_mla --heads 16 > $OUT/ncu_run.log 2>&1; echo rc=$?
$N --import $OUT/prof_few.ncu-rep --page details --print-details all > $OUT/prof_few_details.txt 2>&1
$N --import $OUT/prof_few.ncu-rep --page source --csv --print-source sass > $OUT/prof_few_sass.csv 2>&1
gzip -f $OUT/prof_few_sass.csv; rm -f $OUT/prof_few.ncu-rep
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Warp Cycles Per Issued|Issue Slots Busy|Registers|Achieved Occupancy" $OUT/prof_few_details.txt | head -20
timeout 200 python3 benchmarks/few_sweep.py --formats fp8_ds_mla,fp8 --heads 16,32 --splits 0 --batches 128,1,4 --reps 20 --out $OUT/few3.json 2>&1 | tail -14
