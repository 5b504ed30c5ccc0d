export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py -x -k "16-2048-1 or dispatch" 2>&1 | tail -25 > $OUT/t1.log
cat $OUT/t1.log | tail -25
timeout 240 python3 benchmarks/few_sweep.py --formats fp8_ds_mla,fp8,bf16 --heads 16 --splits 0,1 --reps 20 --out $OUT/few1.json 2>&1 | tail -20
