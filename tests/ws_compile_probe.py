"""Compile the warp-specialized Gluon kernels for sm_90 (no GPU needed) and print, as JSON, per kernel and
rope width: shared memory bytes, stack bytes (spills) and whether the PTX is warp-specialized.  Run in a
process without TRITON_INTERPRET (under the interpreter the kernels are not compiled);
tests/test_ws_attention.py calls it."""
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsemla.kernels.ws_pair import ws_pair_kernel  # noqa: E402
from sparsemla.kernels.ws_tile import ws_tile_kernel  # noqa: E402

SIG = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "kv_ptr": "*u8", "idx_ptr": "*i32",
       "stride_it": "i32", "vc_ptr": "*i32", "o_ptr": "*bf16", "stride_ot": "i32", "stride_os": "i32",
       "stride_oh": "i32", "lse_ptr": "*fp32", "stride_lt": "i32", "stride_ls": "i32", "stride_lh": "i32",
       "sm_scale_log2": "fp32", "H": "i32", "K": "i32", "rows_per_split": "i32", "num_splits": "i32"}
KERNELS = {"pair": (ws_pair_kernel, 4, {}), "tile": (ws_tile_kernel, 8, {"GATHER": True})}


def _stack_bytes(cubin):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", res).group(1))


def main():
    out = {}
    for name, (fn, warps, extra) in KERNELS.items():
        for rope in (64, 0):
            cons = dict(BPT=1152 if rope else 1024, ROPE=rope, NG=2, HAS_VC=True, **extra)
            sig = dict(SIG, **{k: "constexpr" for k in cons})
            k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cons),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "maxnreg": 168})
            ptx = k.asm["ptx"]
            out[f"{name}-{rope}"] = dict(smem=k.metadata.shared, stack=_stack_bytes(k.asm["cubin"]),
                                         setmaxnreg="setmaxnreg" in ptx,
                                         mbarrier_cp_async="cp.async.mbarrier.arrive.noinc" in ptx)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
