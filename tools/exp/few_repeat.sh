#!/usr/bin/env bash
# D-h16 kernel-only figures with the peers, twice in fresh processes (run-to-run spread).
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
for i in 1 2; do
  timeout 120 python3 benchmarks/peer_kernels.py --heads 16 --formats fp8_ds_mla,fp8,bf16 --out $OUT/rep$i.json 2>&1 | grep -E "b=|ceil"
done
