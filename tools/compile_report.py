"""Compile the portable attention kernels for sm90 on a machine with no GPU and report registers, spills, shared memory
and which MMA instructions were used.  Costs no device time.

    python tools/compile_report.py [--fmt fp8_ds_mla] [--hb 16] [--bn 64] [--warps 4] [--stages 2] [--dump DIR]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsemla.kernels import sparse_attention as sa  # noqa: E402

COMMON_SIG = {
    "q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "kv_ptr": "*u8", "idx_ptr": "*i32", "stride_it": "i32",
    "vc_ptr": "*i32", "o_ptr": "*fp32", "stride_ot": "i32", "stride_os": "i32", "stride_oh": "i32",
    "lse_ptr": "*fp32", "stride_lt": "i32", "stride_ls": "i32", "stride_lh": "i32", "sm_scale_log2": "fp32",
    "H": "i32", "K": "i32", "rows_per_split": "i32", "num_splits": "i32",
}


def _with_k_scale(sig):
    """The fp8-family / wide signature: k_scale sits between sm_scale_log2 and H."""
    head = {k: v for k, v in sig.items() if k not in ("H", "K", "rows_per_split", "num_splits")}
    return {**head, "k_scale": "fp32", "H": "i32", "K": "i32", "rows_per_split": "i32", "num_splits": "i32"}


def compile_one(fmt, hb, bn, warps, stages, splits=4, rope=64, out_bf16=False, wide=False):
    """Compile one portable attention kernel for sm_90.  wide: the many-heads kernel.  (The sm_90 Gluon
    kernels: tests/helpers/sm90_sass.py.)"""
    sig = dict(COMMON_SIG)
    if out_bf16:
        sig["o_ptr"] = "*bf16"
    cons = dict(HB=hb, BN=bn, NG=1, HAS_VC=True, INTERP=False, ROPE=rope)
    bpt = sa.get_format(fmt if fmt != "staged" else "fp8", rope).bytes_per_token
    if wide:
        fn, sig = sa._fwd_wide_kernel, _with_k_scale(sig)
        cons.update(BPT=bpt, KIND=sa._WIDE_KIND[fmt], STAGED=fmt == "staged")
    elif fmt == "nvfp4_ds_mla":
        fn = sa._fwd_nvfp4_kernel
        cons["BPT"] = bpt
    elif fmt == "bf16":
        fn = sa._fwd_bf16_kernel
    else:
        fn, sig = sa._fwd_fp8_kernel, _with_k_scale(sig)
        cons.update(BPT=bpt, DS=fmt == "fp8_ds_mla", STAGED=fmt == "staged")
    for k in cons:
        sig[k] = "constexpr"
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cons)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def resources(cc):
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cc.asm["cubin"])
        path = f.name
    res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, shared, local = (int(x) for x in m.groups()) if m else (None,) * 4
    ops = {}
    for name in ("HGMMA", "HMMA", "LDG", "LDGSTS", "STS", "LDS", "LDSM", "F2FP", "PRMT", "BAR"):
        ops[name] = len(re.findall(r"\b" + name + r"\.", sass)) + len(re.findall(r"\b" + name + r"\s", sass))
    return dict(regs=regs, stack=stack, local=local, smem=cc.metadata.shared, sass_lines=sass.count("\n"), **ops)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", nargs="+", default=["fp8_ds_mla", "nvfp4_ds_mla", "bf16", "fp8"])
    ap.add_argument("--hb", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--bn", nargs="+", type=int, default=[64])
    ap.add_argument("--warps", nargs="+", type=int, default=[4])
    ap.add_argument("--stages", nargs="+", type=int, default=[2])
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--wide", action="store_true", help="the many-heads kernel (_fwd_wide_kernel)")
    a = ap.parse_args(argv)
    for fmt in a.fmt:
        for hb in a.hb:
            for bn in a.bn:
                for w in a.warps:
                    for st in a.stages:
                        try:
                            cc = compile_one(fmt, hb, bn, w, st, rope=a.rope, wide=a.wide)
                        except Exception as e:  # report and go on
                            print(f"{fmt:14s} HB={hb:3d} BN={bn:3d} w={w} st={st}: FAILED {type(e).__name__}: {str(e)[:300]}")
                            continue
                        r = resources(cc)
                        print(f"{fmt:14s} HB={hb:3d} BN={bn:3d} w={w} st={st}: " + " ".join(f"{k}={v}" for k, v in r.items()))
                        if a.dump:
                            os.makedirs(a.dump, exist_ok=True)
                            for ext in ("ttgir", "ptx"):
                                with open(os.path.join(a.dump, f"{'wide_' if a.wide else ''}{fmt}_hb{hb}_bn{bn}_w{w}_s{st}.{ext}"), "w") as f:
                                    f.write(cc.asm[ext])


if __name__ == "__main__":
    main()
