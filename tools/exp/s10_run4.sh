#!/usr/bin/env bash
# Tenth session, call 5: the combine step through programmatic dependent launch (A/B at small batches), then
# every attention GPU test, the runner / layer / CLI tests and memcheck, in parallel.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
timeout 200 python3 tools/exp/s10_pdl.py --out $OUT/pdl.json 2>&1 | grep -v Warning
run() { name=$1; shift; ( timeout 270 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log" ) & }
run t_wide python3 -m pytest -q -m gpu tests/gpu/test_ws_wide_gpu.py
run t_few python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py tests/gpu/test_ws_attention_gpu.py
run t_attn python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py
run t_rlc python3 -m pytest -q -m gpu tests/gpu/test_runner_gpu.py tests/gpu/test_layer_gpu.py tests/gpu/test_cli_gpu.py
run t_san env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
wait
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "passed|failed|rc=|ERROR SUMMARY" "$f" | tail -3; done
grep -E "^FAILED|Error:" "$OUT"/t_*.log | head -10
