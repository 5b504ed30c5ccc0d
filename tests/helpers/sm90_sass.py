"""Compile every sm_90 Gluon kernel variant on the CPU and report, per variant, a hash of its SASS, its
registers, stack (spill) bytes, shared memory, instruction counts, and whether the PTX is warp-specialized
(setmaxnreg), mbarrier-fed (cp.async.mbarrier.arrive.noinc) and whether ptxas serialized the wgmma pipeline.

    python tests/helpers/sm90_sass.py [NAME ...] [--json FILE] [--jobs N]

The SASS hash is taken over the instructions of ``cuobjdump -sass`` with function names and instruction
addresses / encodings removed, so two builds of one variant hash alike when they differ only in names.
Run it in a process without TRITON_INTERPRET (under the interpreter nothing is compiled).  It needs no GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SIG = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "kv_ptr": "*u8", "idx_ptr": "*i32",
       "stride_it": "i32", "vc_ptr": "*i32", "o_ptr": "*bf16", "stride_ot": "i32", "stride_os": "i32",
       "stride_oh": "i32", "lse_ptr": "*fp32", "stride_lt": "i32", "stride_ls": "i32", "stride_lh": "i32",
       "sm_scale_log2": "fp32", "H": "i32", "K": "i32", "rows_per_split": "i32", "num_splits": "i32"}
SIG_K = dict(list(SIG.items())[:16] + [("k_scale", "fp32")] + list(SIG.items())[16:])


def _variants():
    """name -> (module, kernel, num_warps, signature, constexprs)."""
    v = {}
    for rope in (64, 0):
        v[f"pair-{rope}"] = ("sm90.bf16", "ws_pair_kernel", 4, SIG,
                             dict(BPT=1152 if rope else 1024, ROPE=rope, NG=2, HAS_VC=True))
    for name, ds, rope, bpt, fp4, f8 in [("ds-64", True, 64, 656, False, False), ("ds-0", True, 0, 528, False, False),
                                         ("fp8-64", False, 64, 576, False, False), ("fp8-0", False, 0, 512, False, False),
                                         ("fp4-64", False, 64, 352, True, False), ("fp4-0", False, 0, 288, True, False),
                                         ("ds8-64", True, 64, 656, False, True), ("ds8-0", True, 0, 528, False, True),
                                         ("fp88-64", False, 64, 576, False, True), ("fp88-0", False, 0, 512, False, True)]:
        v[f"few-{name}"] = ("sm90.few", "ws_few_kernel", 4, SIG_K,
                            dict(BPT=bpt, DS=ds, ROPE=rope, NG=2, HAS_VC=True, FP4=fp4, F8=f8))
        if not fp4:
            v[f"wide-{name}"] = ("sm90.wide", "ws_wide_kernel", 4, SIG_K,
                                 dict(BPT=bpt, DS=ds, ROPE=rope, NG=2, HAS_VC=True, F8=f8))
    return v


VARIANTS = _variants()


def _tool(name):
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def normalized_sass(sass: str) -> list:
    """The instructions of ``cuobjdump -sass`` output, without addresses, encodings or function names."""
    names = set(re.findall(r"Function\s*:\s*(\S+)", sass))
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if not m:
            continue
        ins = m.group(1)
        for n in names:
            ins = ins.replace(n, "<fn>")
        out.append(re.sub(r"\s+", " ", ins))
    return out


def _opcode(ins: str) -> str:
    tok = ins.split()
    if tok and tok[0].startswith("@"):
        tok = tok[1:]
    return tok[0] if tok else ""


def compile_variant(name: str):
    """Compile one variant for sm_90; returns (CompiledKernel, ptxas log)."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    mod, fn_name, warps, sig, cons = VARIANTS[name]
    fn = getattr(importlib.import_module(f"sparsemla.kernels.{mod}"), fn_name)
    sig = dict(sig, **{k: "constexpr" for k in cons})
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
        knobs.cache.dir = cache  # a fresh build, so that ptxas runs and its log is seen
        knobs.nvidia.dump_ptxas_log = True
        k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cons),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "maxnreg": 168})
    return k, log.getvalue()


def report(name: str) -> dict:
    """Compile ``name`` and summarize it (see the module docstring)."""
    k, log = compile_variant(name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", res).groups())
    ins = normalized_sass(sass)
    counts = {}
    for i in ins:
        op = _opcode(i).split(".")[0]
        counts[op] = counts.get(op, 0) + 1
    ptx = k.asm["ptx"]
    return dict(sass_sha=hashlib.sha256("\n".join(ins).encode()).hexdigest()[:16], instructions=len(ins),
                regs=regs, stack=stack, smem=k.metadata.shared, setmaxnreg="setmaxnreg" in ptx,
                mbarrier_cp_async="cp.async.mbarrier.arrive.noinc" in ptx, serialized="serialized" in log,
                ops={op: counts[op] for op in sorted(counts)})


def _report_or_error(name):
    try:
        return name, report(name)
    except Exception as e:  # reported per variant: one failure does not hide the others
        return name, {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}


def run(names, jobs=1) -> dict:
    """{name: report} for ``names``, compiled in ``jobs`` processes."""
    if jobs <= 1:
        return dict(_report_or_error(n) for n in names)
    with ProcessPoolExecutor(jobs) as ex:
        return dict(ex.map(_report_or_error, names))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="variants (default: all)")
    ap.add_argument("--json", help="write the full reports here")
    ap.add_argument("--jobs", type=int, default=1)
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: nothing is compiled under the interpreter")
    names = a.names or list(VARIANTS)
    out = run(names, a.jobs)
    import triton
    print(f"triton {triton.__version__}")
    for n in names:
        r = out[n]
        if "error" in r:
            print(f"{n:14s} ERROR {r['error'].splitlines()[0][:200]}")
        else:
            print(f"{n:14s} sass {r['sass_sha']} ins {r['instructions']:6d} regs {r['regs']:3d} stack {r['stack']:4d} "
                  f"smem {r['smem']:6d} setmaxnreg {int(r['setmaxnreg'])} cp.async-mbar {int(r['mbarrier_cp_async'])} "
                  f"serialized {int(r['serialized'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"triton": triton.__version__, "variants": out}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
