#!/usr/bin/env bash
# Seventh session, last H200 call (after the fp8_ds_mla per-group QK accumulators and the paired PV
# conversion): the few-heads kernel's tests, the attention suite and memcheck in parallel, then the decode
# benchmark with the peers (D-h16 / D-h32) and D-small (graph).
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
run() { name=$1; shift; ( timeout 230 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_few python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|Error|error|rc=|ERROR SUMMARY" "$f" | tail -3; done
grep -E "^FAILED|Assertion" "$OUT"/t_*.log | head -10
timeout 150 python3 benchmarks/peer_kernels.py --heads 16,32 --formats fp8_ds_mla,fp8,nvfp4_ds_mla,bf16 --out $OUT/peers-few.json 2>&1 | grep -E "b=|ceil" > $OUT/peers.log
timeout 80 python3 benchmarks/peer_kernels.py --batches 1,4 --heads 16 --formats fp8_ds_mla,fp8,nvfp4_ds_mla --graph --out $OUT/small-few.json 2>&1 | grep -E "b=|ceil" > $OUT/small.log
cat $OUT/peers.log $OUT/small.log
