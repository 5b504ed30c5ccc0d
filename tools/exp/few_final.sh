#!/usr/bin/env bash
# Sixth session, final H200 call: the GPU tests touched by the few-heads FP8 kernel and its split plan, the
# memcheck run (in parallel), then the decode benchmark with the peers (kernel only) and D-small (graph).
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
run() { name=$1; shift; ( timeout 300 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_few python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py -k "fp8 and not nvfp4"
run t_sys python3 -m pytest -q -m gpu tests/gpu/test_runner_gpu.py tests/gpu/test_layer_gpu.py -rs
run t_sanitize env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|error|rc=|ERROR SUMMARY" "$f" | tail -3; done
timeout 170 python3 benchmarks/peer_kernels.py --heads 16,32 --formats fp8,fp8_ds_mla,bf16 --out $OUT/peers-few.json 2>&1 | grep -E "b=|ceil" > $OUT/peers.log
timeout 80 python3 benchmarks/peer_kernels.py --batches 1,4 --heads 16 --formats fp8,fp8_ds_mla --graph --out $OUT/small-few.json 2>&1 | grep -E "b=|ceil" > $OUT/small.log
cat $OUT/peers.log $OUT/small.log
