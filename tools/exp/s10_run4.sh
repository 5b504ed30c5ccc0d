#!/usr/bin/env bash
# Tenth session, call 5: the combine step through programmatic dependent launch (A/B at small batches), then
# every attention GPU test, the runner / layer / CLI tests and memcheck, in parallel.
set -u
source tools/peers_env.sh
timeout 200 python3 tools/exp/s10_pdl.py --out $OUT/pdl.json 2>&1 | grep -v Warning
bash tools/exp/kernel_tests.sh 270 system
