#!/usr/bin/env bash
# Tenth session, last H200 call: the few-heads kernel in 16-head groups above 32 heads at small batches (the
# new dispatch, ws_attention.FEW_WAVES): the Gluon kernels' tests, the attention suite and memcheck in
# parallel, then table 1b (D-small, graph replay, peers in the same process) and D-h64 nvfp4.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
run() { name=$1; shift; ( timeout 260 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_wide python3 -m pytest -q -m gpu tests/gpu/test_ws_wide_gpu.py
run t_few python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py tests/gpu/test_ws_attention_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|rc=|ERROR SUMMARY" "$f" | tail -3; done
grep -E "^FAILED|Error:" "$OUT"/t_*.log | head -10
timeout 150 python3 benchmarks/peer_kernels.py --batches 1,4,16 --heads 16,64,128 --graph \
  --formats fp8_ds_mla,fp8,nvfp4_ds_mla,bf16 --out $OUT/small.json 2>&1 | grep -E "b=|ceil"
timeout 60 python3 benchmarks/peer_kernels.py --heads 64 --formats nvfp4_ds_mla,bf16 --out $OUT/nvfp4-h64.json 2>&1 | grep -E "b=|ceil"
