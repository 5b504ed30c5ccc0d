#!/usr/bin/env bash
# Eighth session, last H200 call (ws_wide as committed): the wide kernel's tests, the attention suite,
# runner / layer and memcheck in parallel, then D-h64 / D-h128 with the peers and D-small at 128 heads.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
run() { name=$1; shift; ( timeout 290 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_wide python3 -m pytest -q -m gpu tests/gpu/test_ws_wide_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py
run t_run python3 -m pytest -q -m gpu tests/gpu/test_runner_gpu.py tests/gpu/test_layer_gpu.py
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|Error|error|rc=|ERROR SUMMARY" "$f" | tail -3; done
grep -E "^FAILED|Assertion" "$OUT"/t_*.log | head -10
timeout 170 python3 benchmarks/peer_kernels.py --heads 64,128 --formats fp8_ds_mla,fp8,bf16 --out $OUT/peers-wide.json 2>&1 | grep -E "b=|ceil" > $OUT/peers.log
timeout 80 python3 benchmarks/peer_kernels.py --batches 1,4 --heads 128 --formats fp8_ds_mla,fp8 --graph --out $OUT/small-wide.json 2>&1 | grep -E "b=|ceil" > $OUT/small.log
cat $OUT/peers.log $OUT/small.log
