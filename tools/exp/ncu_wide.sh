#!/usr/bin/env bash
# Nsight Compute on the wide bf16 kernel (P-2k, 128 heads): details + per-SASS stall samples into $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
which ncu || ls /usr/local/cuda*/bin/ncu
N=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
timeout 280 $N --clock-control none -k regex:_fwd_wide -c 1 --set full --import-source no -o $OUT/prof_bf16 python3 benchmarks/profile_one.py --fmt bf16 --heads 128 --batch 1 --s-q 2048 > $OUT/ncu_run.log 2>&1; echo rc=$?
$N --import $OUT/prof_bf16.ncu-rep --page details --print-details all > $OUT/prof_bf16_details.txt 2>&1
$N --import $OUT/prof_bf16.ncu-rep --page source --csv --print-source sass > $OUT/prof_bf16_sass.csv 2>&1
ls -la $OUT; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Issue Slots Busy|Stall|Registers|Achieved Occupancy" $OUT/prof_bf16_details.txt | head -40
rm -f $OUT/prof_bf16.ncu-rep
