#!/usr/bin/env bash
# Eighth session, second H200 call: ws_wide with lazy rescaling and block 2i multiplied first by both
# warpgroups (v2) against the first version (commit 52f8a4c; a file copy under tools/exp when this ran) in one process; a subset of its tests.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x -m gpu tests/gpu/test_ws_wide_gpu.py -k "2048 or 2051 or far or k_scale" > $OUT/t_wide.log 2>&1; echo "rc=$?" >> $OUT/t_wide.log
tail -5 $OUT/t_wide.log
timeout 250 python3 tools/exp/wide_ab.py --mods sparsemla.kernels.ws_wide,git:52f8a4c --heads 64,128 --out $OUT/ab2.json 2>&1 | tail -20
