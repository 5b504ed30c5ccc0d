export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
( timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_sparse_attention_gpu.py > $OUT/t_attention.log 2>&1; echo rc=$? >> $OUT/t_attention.log ) &
( timeout 300 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py > $OUT/t_sanitize.log 2>&1; echo rc=$? >> $OUT/t_sanitize.log ) &
wait
tail -3 $OUT/t_attention.log; tail -4 $OUT/t_sanitize.log
timeout 200 python3 benchmarks/decode_sweep.py --plan s3b --jobs 8 --out $OUT/s3b.json > $OUT/s3b.txt 2>&1; echo sweep rc=$?
cat $OUT/s3b.txt
timeout 150 python3 benchmarks/prefill_runner.py --heads 128 16 --reps 5 --out $OUT/prefill.json > $OUT/prefill.txt 2>&1; echo prefill rc=$?
cat $OUT/prefill.txt
