#!/usr/bin/env bash
# Last device call of the third session: attention tests + memcheck on the final kernel configuration, then
# prefill through the runner and the wide-kernel decode rows whose defaults changed (bf16/NVFP4 at 3 stages).
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
( timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py > $OUT/t_attention.log 2>&1; echo rc=$? >> $OUT/t_attention.log ) &
( timeout 240 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py > $OUT/t_sanitize.log 2>&1; echo rc=$? >> $OUT/t_sanitize.log ) &
wait
tail -2 $OUT/t_attention.log; tail -2 $OUT/t_sanitize.log
timeout 60 python3 benchmarks/prefill_runner.py --heads 128 --reps 5 --out $OUT/prefill.json > $OUT/prefill.txt 2>&1; cat $OUT/prefill.txt
timeout 60 python3 benchmarks/peer_kernels.py --formats bf16,nvfp4_ds_mla --heads 64,128 --out $OUT/peers.json 2>&1 | grep -v "Warn\|w.plan\|return lambda"
