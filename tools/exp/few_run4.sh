export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py -x -k "2048 or dispatch or k_scale" 2>&1 | tail -5
timeout 300 python3 benchmarks/few_sweep.py --formats fp8_ds_mla,fp8,bf16 --heads 16,32 --splits 0 --batches 128,1,4 --reps 30 --out $OUT/few4.json 2>&1 | tail -20
