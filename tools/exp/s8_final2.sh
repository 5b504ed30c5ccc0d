#!/usr/bin/env bash
# Eighth session, last H200 call: the peers at D-h64 / D-h128 (the previous call did not carry them), and
# where the wide kernel for quantized rows stops paying at small batches (b 1 / 16 / 64, 128 heads, split
# counts) against the Triton wide kernel.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
timeout 170 python3 benchmarks/peer_kernels.py --heads 64,128 --formats fp8_ds_mla,fp8,bf16 --out $OUT/peers-wide.json 2>&1 | grep -E "b=|ceil"
timeout 200 python3 benchmarks/few_sweep.py --heads 128 --batches 1,16,64 --formats fp8_ds_mla --splits 0,1,4,16 --reps 15 --out $OUT/small-sweep.json 2>&1 | tail -24
