#!/usr/bin/env bash
# Fourth session: fp8_ds_mla few-heads kernel (one scale load, one [4] max, accumulators held divided by the
# previous tile's scale max) against the version before (old_sa_108e9f5.py = git show 108e9f5:...), NoPE
# decode rows, then the attention GPU tests and memcheck on the new kernel.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SMLA_OLD_SRC=$PWD/old_sa_108e9f5.py timeout 300 python3 benchmarks/decode_sweep.py --plan dsv2 --jobs 4 --out $OUT/dsv2.json > $OUT/dsv2.log 2>&1
timeout 150 python3 benchmarks/peer_kernels.py --formats bf16-nope,fp8-nope,fp8_ds_mla-nope,nvfp4_ds_mla-nope --heads 16,64,128 --out $OUT/nope.json > $OUT/nope.log 2>&1
( timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py > $OUT/t_attention.log 2>&1; echo rc=$? >> $OUT/t_attention.log ) &
( PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py > $OUT/t_sanitize.log 2>&1; echo rc=$? >> $OUT/t_sanitize.log ) &
wait
grep -v "^$" $OUT/dsv2.log | cut -c1-160; grep -v Warn $OUT/nope.log; tail -2 $OUT/t_attention.log; grep -E "ERROR SUMMARY|rc=" $OUT/t_sanitize.log
