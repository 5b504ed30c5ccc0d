#!/usr/bin/env bash
# Fourth session, third H200 call: Nsight Compute on the NVFP4 and fp8_ds_mla cache writes and on the
# transposed few-heads kernel (bf16, fp8_ds_mla; decode_sweep plan "narrow" measured it 2-3x slower).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
N=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
prof() {  # name kernel-regex command...
  name=$1; kre=$2; shift 2
  timeout 150 $N --clock-control none -k regex:$kre -c 1 --set full --import-source no -o /tmp/prof_$name "$@" > /tmp/ncu_$name.log 2>&1
  $N --import /tmp/prof_$name.ncu-rep --page details --print-details all > /tmp/prof_${name}_details.txt 2>&1
  $N --import /tmp/prof_$name.ncu-rep --page source --csv --print-source sass > /tmp/prof_${name}_sass.csv 2>&1
  echo "== $name"; grep -E "^    Duration|DRAM Throughput|Warp Cycles Per Issued|Issue Slots Busy|Registers Per|Achieved Occupancy|Block Limit (Reg|Shared)" /tmp/prof_${name}_details.txt | head -9
}
prof w_nvfp4 _cache_write python3 tools/exp/profile_write.py --fmt nvfp4_ds_mla
prof w_ds _cache_write python3 tools/exp/profile_write.py --fmt fp8_ds_mla
prof n_bf16 _fwd_narrow python3 benchmarks/profile_one.py --fmt bf16 --heads 16 --narrow
prof n_ds _fwd_narrow python3 benchmarks/profile_one.py --fmt fp8_ds_mla --heads 16 --narrow
cd /tmp && tar czf $OUT/prof.tgz prof_*_details.txt prof_*_sass.csv ncu_*.log
