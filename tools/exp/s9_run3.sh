#!/usr/bin/env bash
# Ninth session, call 3: per-program and per-pair cost of three ws_wide versions; ws_few fp8_ds_mla A/B.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 400 python3 tools/exp/s9_ab.py --wide git:17284d2,sparsemla.kernels.ws_wide,sparsemla.kernels._ws_wide_b \
   --few git:17284d2,sparsemla.kernels.ws_few --few-formats fp8_ds_mla --out $OUT/s9_ab.json > $OUT/s9_ab.log 2>&1; echo rc=$?
python3 - <<'PY'
import json, os, collections
p = os.environ["OUT"] + "/s9_ab.json"
rows = json.load(open(p))["rows"] if os.path.exists(p) else []
d = collections.defaultdict(list)
for r in rows: d[(r["kernel"], r["fmt"], r["topk"], r["mod"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
tail -3 $OUT/s9_ab.log
