#!/usr/bin/env bash
# The per-group P allocations: the few-heads tests, then D-h16 with the peers.
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py -k "16-2048 or 20-2051 or 1-64 or k_scale" 2>&1 | tail -2
timeout 100 python3 benchmarks/peer_kernels.py --heads 16 --formats fp8_ds_mla,fp8 --out $OUT/pb.json 2>&1 | grep -E "b=|ceil"
