"""Compile the warp-specialized Gluon kernels for sm_90 (no GPU needed) and print, as JSON, per kernel and
rope width (and the few-heads and wide kernels for quantized rows per format variant): shared memory bytes, stack bytes (spills),
whether the PTX is warp-specialized and whether ptxas serialized the wgmma pipeline.  Run in a
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
from sparsemla.kernels.ws_few import ws_few_kernel  # noqa: E402

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


def _serialized(ptx):
    """Whether ptxas reports the wgmma pipeline serialized (e.g. an accumulator read while in flight)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([tool, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    return "serialized" in res.stdout + res.stderr


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
    few_sig = dict(SIG, k_scale="fp32")
    for name, ds, rope, bpt, fp4, f8 in [("ds-64", True, 64, 656, False, False), ("ds-0", True, 0, 528, False, False),
                                         ("fp8-64", False, 64, 576, False, False), ("fp8-0", False, 0, 512, False, False),
                                         ("fp4-64", False, 64, 352, True, False), ("fp4-0", False, 0, 288, True, False),
                                         ("ds8-64", True, 64, 656, False, True), ("ds8-0", True, 0, 528, False, True),
                                         ("fp88-64", False, 64, 576, False, True), ("fp88-0", False, 0, 512, False, True)]:
        cons = dict(BPT=bpt, DS=ds, ROPE=rope, NG=2, HAS_VC=True, FP4=fp4, F8=f8)
        sig = dict(few_sig, **{k: "constexpr" for k in cons})
        k = triton.compile(GluonASTSource(fn=ws_few_kernel, signature=sig, constexprs=cons),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
        ptx = k.asm["ptx"]
        out[f"few-{name}"] = dict(smem=k.metadata.shared, stack=_stack_bytes(k.asm["cubin"]),
                                  setmaxnreg="setmaxnreg" in ptx,
                                  mbarrier_cp_async="cp.async.mbarrier.arrive.noinc" in ptx,
                                  serialized=_serialized(ptx))
    from sparsemla.kernels.ws_wide import ws_wide_kernel
    for name, ds, rope, bpt, f8 in [("ds-64", True, 64, 656, False), ("ds-0", True, 0, 528, False),
                                    ("fp8-64", False, 64, 576, False), ("fp8-0", False, 0, 512, False),
                                    ("ds8-64", True, 64, 656, True), ("ds8-0", True, 0, 528, True),
                                    ("fp88-64", False, 64, 576, True), ("fp88-0", False, 0, 512, True)]:
        cons = dict(BPT=bpt, DS=ds, ROPE=rope, NG=2, HAS_VC=True, F8=f8)
        sig = dict(few_sig, **{k: "constexpr" for k in cons})
        k = triton.compile(GluonASTSource(fn=ws_wide_kernel, signature=sig, constexprs=cons),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
        ptx = k.asm["ptx"]
        out[f"wide-{name}"] = dict(smem=k.metadata.shared, stack=_stack_bytes(k.asm["cubin"]),
                                   setmaxnreg="setmaxnreg" in ptx,
                                   mbarrier_cp_async="cp.async.mbarrier.arrive.noinc" in ptx,
                                   serialized=_serialized(ptx))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
