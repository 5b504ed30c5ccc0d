export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py -x -k "16-2048-1 or 20-2051 or 5-2048 or k_scale" 2>&1 | tail -3
for i in 1 2; do for m in chain groups; do
  echo "== $m $i"; SPARSEMLA_FEW_QK=$m timeout 100 python3 benchmarks/few_sweep.py --formats fp8_ds_mla,fp8 --heads 16 --splits 0 --batches 128,1 --reps 30 --no-triton 2>&1 | grep '"ws"' | cut -c1-90
done; done
