#!/usr/bin/env bash
# Eighth session, third H200 call: Nsight Compute on ws_wide (fp8_ds_mla, D-h128: stall reasons per SASS
# line), then the A/B of v3 (PV steps retired one behind, no drain per step) against v2 (commit 1275410; a file copy under tools/exp when this ran).
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
N=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
timeout 200 $N --clock-control none -k regex:ws_wide -c 1 --set full --import-source no -o $OUT/prof_wide python3 benchmarks/profile_one.py --fmt fp8_ds_mla --heads 128 --batch 128 > $OUT/ncu_run.log 2>&1; echo ncu rc=$?
$N --import $OUT/prof_wide.ncu-rep --page details --print-details all > $OUT/prof_wide_details.txt 2>&1
$N --import $OUT/prof_wide.ncu-rep --page source --csv --print-source sass > $OUT/prof_wide_sass.csv 2>&1
rm -f $OUT/prof_wide.ncu-rep
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Issue Slots Busy|Registers|Achieved Occupancy|SM Frequency" $OUT/prof_wide_details.txt | head -20
timeout 200 python3 tools/exp/wide_ab.py --mods sparsemla.kernels.ws_wide,git:1275410 --heads 64,128 --out $OUT/ab3.json 2>&1 | tail -16
