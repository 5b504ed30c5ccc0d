export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py -x 2>&1 | tail -25 > $OUT/t2.log
tail -5 $OUT/t2.log
timeout 260 python3 benchmarks/few_sweep.py --formats fp8_ds_mla,fp8,fp8_ds_mla-nope,bf16 --heads 16,32 --splits 0,1,2 --reps 20 --out $OUT/few2.json 2>&1 | tail -30
