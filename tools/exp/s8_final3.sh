#!/usr/bin/env bash
# Eighth session, after the small-batch dispatch rule: the wide kernel's tests, D-small at 128 heads (graph)
# and the b 32 crossover (ws vs Triton) at 128 heads.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_ws_wide_gpu.py > $OUT/t_wide.log 2>&1; echo "rc=$?" >> $OUT/t_wide.log
tail -3 $OUT/t_wide.log
timeout 80 python3 benchmarks/peer_kernels.py --batches 1,4 --heads 128 --formats fp8_ds_mla,fp8 --graph --out $OUT/small-wide.json 2>&1 | grep -E "b=|ceil"
timeout 100 python3 benchmarks/few_sweep.py --heads 128 --batches 32 --formats fp8_ds_mla,fp8 --splits 0 --reps 15 --out $OUT/b32.json 2>&1 | tail -4
