#!/usr/bin/env bash
# After the review commit: the few-heads kernel's tests (every format variant) and a pair-kernel test.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 140 python3 -m pytest -q -m gpu tests/gpu/test_ws_few_gpu.py tests/gpu/test_ws_attention_gpu.py \
  -k "16-2048-1 or 20-2051 or k_scale or dispatch or (pair and bf16-64-2048)" 2>&1 | tail -3
