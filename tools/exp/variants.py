"""Experimental variants of the attention kernels, generated from the library source by text edits so they
stay in sync with it.  Used by benchmarks/decode_sweep.py (--variants) to time design alternatives on the
GPU; "diag-*" variants compute wrong results on purpose and exist only to measure what a part costs."""
import importlib.util
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "sparsemla", "kernels", "sparse_attention.py")


def _section(src, start, end_marker="# ----"):
    a = src.index(start)
    b = src.index(end_marker, a)
    return src[a:b]


def build():
    src = open(SRC).read()
    out = {}
    fp8 = _section(src, "@triton.jit\ndef _fwd_fp8_kernel")
    nv = _section(src, "@triton.jit\ndef _fwd_nvfp4_kernel")

    # fp8_ds_mla, diag: ignore the tile scales on the PV side (single P tile) -> cost of the 4 P tiles
    v = fp8.replace("_fwd_fp8_kernel", "_v_ds_singlep")
    old = v[v.index("        if DS:\n            # Value scales go into P"):v.index("        else:\n            p16 = p.to(tl.float16)")]
    v = v.replace(old, "        if DS:\n            p16 = p.to(tl.float16)\n            ae0 = tl.dot(p16, ke0, ae0 * a2)\n            ao0 = tl.dot(p16, ko0, ao0 * a2)\n            ae1 = tl.dot(p16, ke1, ae1 * a2)\n            ao1 = tl.dot(p16, ko1, ao1 * a2)\n            ae2 = tl.dot(p16, ke2, ae2 * a2)\n            ao2 = tl.dot(p16, ko2, ao2 * a2)\n            ae3 = tl.dot(p16, ke3, ae3 * a2)\n            ao3 = tl.dot(p16, ko3, ao3 * a2)\n")
    out["diag-ds-singlep"] = v
    # nvfp4, diag: no block-scale multiply -> cost of the scale path
    v = nv.replace("_fwd_nvfp4_kernel", "_v_nv_noscale")
    for j in range(4):
        v = v.replace(f"        k{j}_ = k{j}_ * sf\n", "")
    v = v.replace("        sf = _nvfp4_lane_scales(base, vmask, SCALE_OFF, BN)\n", "")
    out["diag-nv-noscale"] = v
    # every K tile converted once: the packed conversions made impure, so Triton cannot clone them per
    # dot operand (it then converts once and moves the fp16 tile through shared memory for each dot)
    out["impure-fp8"] = fp8.replace("_fwd_fp8_kernel", "_v_impure_fp8")
    out["impure-nv"] = nv.replace("_fwd_nvfp4_kernel", "_v_impure_nv")
    # an older library version of the fp8-family kernel (A/B in one process): SMLA_OLD_SRC = a copy of that
    # version's sparse_attention.py
    if os.environ.get("SMLA_OLD_SRC"):
        old = open(os.environ["SMLA_OLD_SRC"]).read()
        out["old-fp8"] = _section(old, "@triton.jit\ndef _fwd_fp8_kernel").replace("_fwd_fp8_kernel", "_v_old_fp8")
    header = src[:src.index("# --------------------------------------------------------------------------------------------------------\n# fp8 family")]
    mods = {}
    d = tempfile.mkdtemp(prefix="smla_variants_")
    for name, body in out.items():
        path = os.path.join(d, name.replace("-", "_") + ".py")
        nv_scales = src[src.index("@triton.jit\ndef _nvfp4_lane_scales"):src.index("@triton.jit\ndef _fwd_nvfp4_kernel")]
        helpers = _section(src, "@triton.jit\ndef _fp8_group") + nv_scales
        head = header.replace("is_pure=True", "is_pure=False") if name.startswith("impure") else header
        with open(path, "w") as f:
            f.write(head.replace("from ..formats", "from sparsemla.formats").replace("from ._runtime", "from sparsemla.kernels._runtime"))
            f.write(helpers)
            f.write(body)
        spec = importlib.util.spec_from_file_location(name.replace("-", "_"), path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        fn = [getattr(mod, n) for n in dir(mod) if n.startswith("_v_")][0]
        mods[name] = fn
    return mods


if __name__ == "__main__":
    print(build())
