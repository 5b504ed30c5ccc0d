#!/usr/bin/env bash
# Ninth session, call 4: which part of the change slows ws_wide's fp8_ds_mla loop (per pair): old staging +
# new epilogue (_wv_r0c0s1), new staging + old epilogue (_ws_wide_e), both new (_ws_wide_b), HEAD.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 python3 tools/exp/s9_ab.py --wide git:17284d2,sparsemla.kernels._wv_r0c0s1,sparsemla.kernels._ws_wide_e,sparsemla.kernels._ws_wide_b \
   --wide-formats fp8_ds_mla --out $OUT/s9_ab4.json > $OUT/s9_ab4.log 2>&1; echo rc=$?
python3 - <<'PY'
import json, os, collections
p = os.environ["OUT"] + "/s9_ab4.json"
rows = json.load(open(p))["rows"] if os.path.exists(p) else []
d = collections.defaultdict(list)
for r in rows: d[(r["kernel"], r["fmt"], r["topk"], r["mod"])].append(r["us"])
for k, v in sorted(d.items()): print(k, v)
PY
tail -3 $OUT/s9_ab4.log
