#!/usr/bin/env bash
# Seventh session, verification of the last kernel change (plain fp8 PV operands from 128-bit loads): the
# few-heads kernel's tests, the fp8 attention tests and memcheck in parallel, then fp8 D-h16 / D-h32 with
# the peers.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export PYTHONPATH=/tmp/site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws
run() { name=$1; shift; ( timeout 200 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_few python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py -k "fp8 and not nvfp4 and not ds"
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|Error|error|rc=|ERROR SUMMARY" "$f" | tail -3; done
grep -E "^FAILED|Assertion" "$OUT"/t_*.log | head -10
timeout 60 python3 benchmarks/peer_kernels.py --heads 16,32 --formats fp8 --out $OUT/peers-fp8.json 2>&1 | grep -E "b=|ceil"
