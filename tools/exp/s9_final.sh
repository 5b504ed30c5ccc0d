#!/usr/bin/env bash
# Ninth session, last H200 call (ws_wide with the shared-memory epilogue and q staged by both warpgroups;
# ws_few with approximate reciprocals): the Gluon kernels' tests, the attention suite and memcheck in
# parallel, then D-h64 / D-h128 and D-h16 with the peers in the same process.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
run() { name=$1; shift; ( timeout 280 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_wide python3 -m pytest -q -m gpu tests/gpu/test_ws_wide_gpu.py
run t_few python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py tests/gpu/test_ws_attention_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|rc=|ERROR SUMMARY" "$f" | tail -3; done
grep -E "^FAILED|Assertion" "$OUT"/t_*.log | head -10
timeout 170 python3 benchmarks/peer_kernels.py --heads 64,128 --formats fp8_ds_mla,fp8,bf16 --out $OUT/peers-wide.json 2>&1 | grep -E "b=|ceil" > $OUT/peers.log
timeout 90 python3 benchmarks/peer_kernels.py --heads 16 --formats fp8_ds_mla,fp8,nvfp4_ds_mla --out $OUT/peers-h16.json 2>&1 | grep -E "b=|ceil" > $OUT/peers16.log
cat $OUT/peers.log $OUT/peers16.log
