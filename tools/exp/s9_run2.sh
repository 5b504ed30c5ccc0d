#!/usr/bin/env bash
# Ninth session, call 2: A/B of ws_wide (HEAD of the eighth session vs the shared-memory epilogue + split q
# staging, with approximate / IEEE reciprocals in the scores), graph timings at 1 and 16 pairs, the wide tests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 230 python3 tools/exp/wide_ab.py --mods git:17284d2,sparsemla.kernels.ws_wide,sparsemla.kernels._ws_wide_b \
  --formats fp8_ds_mla,fp8 --heads 64,128 --rounds 2 --out $OUT/ab.json > $OUT/ab.log 2>&1; echo ab rc=$?
python3 - <<'PY'
import json, os, collections
rows = json.load(open(os.environ["OUT"] + "/ab.json"))["rows"] if os.path.exists(os.environ["OUT"] + "/ab.json") else []
d = collections.defaultdict(list)
for r in rows: d[(r["fmt"], r["h"], r["mod"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
timeout 90 python3 tools/exp/wide_fixed.py --time > $OUT/fixed_time.jsonl 2>&1; cat $OUT/fixed_time.jsonl | tail -10
timeout 260 python3 -m pytest -q -m gpu tests/gpu/test_ws_wide_gpu.py -x > $OUT/tests.log 2>&1; echo tests rc=$?
tail -5 $OUT/tests.log
