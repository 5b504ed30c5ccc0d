#!/usr/bin/env bash
# Tenth session, call 3: the Gluon kernels' tests, the attention suite and memcheck in parallel (ws_few's lazy
# softmax, the few-heads kernel's head groups above 32 heads at small batches).
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
bash tools/exp/kernel_tests.sh 280
