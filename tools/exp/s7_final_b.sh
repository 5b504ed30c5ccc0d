#!/usr/bin/env bash
# Seventh session, final H200 call B: the decode benchmark with the peers in the same process (kernel only,
# D-h16 / D-h32, every quantized format and bf16), then D-small (b 1 and 4, replayed from a CUDA graph).
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 300 python3 benchmarks/peer_kernels.py --heads 16,32 --formats nvfp4_ds_mla,fp8_ds_mla,fp8,bf16 --out $OUT/peers-few.json 2>&1 | grep -E "b=|ceil" > $OUT/peers.log
timeout 120 python3 benchmarks/peer_kernels.py --batches 1,4 --heads 16 --formats nvfp4_ds_mla,fp8_ds_mla,fp8 --graph --out $OUT/small-few.json 2>&1 | grep -E "b=|ceil" > $OUT/small.log
cat $OUT/peers.log $OUT/small.log
