import sys, os
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../.."))
import triton
from triton.backends.compiler import GPUTarget
import compile_report as cr
import importlib
mod = importlib.import_module(sys.argv[1]); fn = getattr(mod, sys.argv[2])
import os
for hb in [int(x) for x in os.environ.get("HBS","16").split(",")]:
  for bn in [32, 64]:
    for w in [4, 8]:
        sig = dict(cr.COMMON_SIG)
        cons = dict(HB=hb, BN=bn, NUM_SPLITS=4, NG=1, HAS_VC=True, INTERP=False, ROPE=64, BPT=int(sys.argv[3]))
        for k in cons: sig[k] = "constexpr"
        try:
            cc = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cons), target=GPUTarget("cuda", 90, 32), options={"num_warps": w, "num_stages": 2})
        except Exception as e:
            print(hb, bn, w, "FAIL", str(e)[-400:]); continue
        print(hb, bn, w, cr.resources(cc))
        open(f"/tmp/dump/{sys.argv[2]}_{hb}_{bn}_{w}.ttgir", "w").write(cc.asm["ttgir"])
