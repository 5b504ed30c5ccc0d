#!/usr/bin/env bash
# Ninth session, call 5: the new epilogue with the IEEE normaliser (_ws_wide_f) against e and b.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 python3 tools/exp/s9_ab.py --wide sparsemla.kernels._ws_wide_f,sparsemla.kernels._ws_wide_e,sparsemla.kernels._ws_wide_b \
   --wide-formats fp8_ds_mla --out $OUT/s9_ab5.json > $OUT/s9_ab5.log 2>&1; echo rc=$?
python3 - <<'PY'
import json, os, collections
p = os.environ["OUT"] + "/s9_ab5.json"
rows = json.load(open(p))["rows"] if os.path.exists(p) else []
d = collections.defaultdict(list)
for r in rows: d[(r["kernel"], r["fmt"], r["topk"], r["mod"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
tail -3 $OUT/s9_ab5.log
