#!/usr/bin/env bash
# Ninth session, call 1: where ws_wide's fixed cost per program goes (Nsight Compute, b 1, one program,
# 1 and 16 pairs), graph timings per top-k, then the two Gluon GPU test files (refactored helper).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
N=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
python3 tools/exp/wide_fixed.py --time > $OUT/fixed_time.jsonl 2>&1; tail -12 $OUT/fixed_time.jsonl
for tk in 128 2048; do
  timeout 150 $N --clock-control none --cache-control none -k regex:ws_wide -s 2 -c 1 --set full --import-source no \
     -o $OUT/w$tk python3 tools/exp/wide_fixed.py --topk $tk > $OUT/ncu_$tk.log 2>&1; echo ncu rc=$?
  $N --import $OUT/w$tk.ncu-rep --page details --print-details all > $OUT/w${tk}_details.txt 2>&1
  $N --import $OUT/w$tk.ncu-rep --page source --csv --print-source sass > $OUT/w${tk}_sass.csv 2>&1
  grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|No Instruction|Registers Per|Stall" $OUT/w${tk}_details.txt | head -30
  rm -f $OUT/w$tk.ncu-rep
done
timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_ws_wide_gpu.py tests/gpu/test_ws_few_gpu.py -x > $OUT/tests.log 2>&1; echo tests rc=$?
tail -3 $OUT/tests.log
