#!/usr/bin/env bash
# Eleventh session, call 3: every decode-kernel GPU test group after the FP8-arithmetic mode (its own tests in the
# ws_few group, triton-fp8 in the runner tests), compute-sanitizer memcheck (F8 variants included).
set -u
source tools/peers_env.sh
bash tools/exp/kernel_tests.sh 330 system
