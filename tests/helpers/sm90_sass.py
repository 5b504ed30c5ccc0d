"""Compile every sm_90 Gluon kernel variant on the CPU and report, per variant, a hash of its SASS, its
registers, stack (spill) bytes, shared memory, instruction counts, and whether the PTX is warp-specialized
(setmaxnreg), mbarrier-fed (cp.async.mbarrier.arrive.noinc) and whether ptxas serialized the wgmma pipeline.

    python tests/helpers/sm90_sass.py [NAME ...] [--json FILE] [--jobs N]

The SASS hash is taken over the instructions of ``cuobjdump -sass`` with function names and instruction
addresses / encodings removed; the PTX hash over the PTX without names, comments and line info.  Two
sources that differ only in names hash alike in PTX; ptxas schedules around line-info labels, so moving
source lines can reorder SASS instructions of an unchanged PTX program.
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

SIG = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "qr_ptr": "*bf16", "stride_rt": "i32", "stride_rh": "i32", "kv_ptr": "*u8", "idx_ptr": "*i32",
       "stride_it": "i32", "vc_ptr": "*i32", "o_ptr": "*bf16", "stride_ot": "i32", "stride_os": "i32",
       "stride_oh": "i32", "lse_ptr": "*fp32", "stride_lt": "i32", "stride_ls": "i32", "stride_lh": "i32",
       "sm_scale_log2": "fp32", "H": "i32", "K": "i32", "rows_per_split": "i32", "num_splits": "i32",
       "fo_ptr": "*bf16", "stride_ft": "i32", "stride_fh": "i32", "fl_ptr": "*fp32", "stride_gt": "i32",
       "stride_gh": "i32"}
SIG_K = dict(list(SIG.items())[:19] + [("k_scale", "fp32")] + list(SIG.items())[19:])
SIG_SPLIT = dict(SIG, o_ptr="*fp32")  # several splits: fp32 partial outputs
SIG_K_SPLIT = dict(SIG_K, o_ptr="*fp32")
# FUSED variants (the splits merged in the kernel, common.combine_in_kernel): one per kernel family
FUSED = {"few-fp8_ds_mla-fused": ("few", "fp8_ds_mla"), "few-nvfp4_ds_mla-fused": ("few", "nvfp4_ds_mla"),
         "conv-nvfp4_ds_mla-fused": ("conv", "nvfp4_ds_mla"), "conv-bf16-fused": ("conv", "bf16"),
         "bf16-bf16-fused": ("bf16", "bf16")}


# Row layouts by format id: (bytes per row, rope dims, rope offset, scale offset); the byte contract is
# docs/kv-formats.md.  The "-nope" ids of the DS formats are vLLM's rows (the rope slot kept, zero); the
# "-nope-compact" ones the library's own rows without it.
LAYOUTS = {
    "bf16": (1152, 64, 1024, -1), "bf16-nope": (1024, 0, -1, -1),
    "fp8": (576, 64, 512, -1), "fp8-nope": (512, 0, -1, -1),
    "fp8_ds_mla": (656, 64, 528, 512), "fp8_ds_mla-nope": (656, 0, -1, 512), "fp8_ds_mla-nope-compact": (528, 0, -1, 512),
    "nvfp4_ds_mla": (352, 64, 256, 320), "nvfp4_ds_mla-nope": (352, 0, -1, 320),
    "nvfp4_ds_mla-nope-compact": (288, 0, -1, 256),
}


def _variants():
    """name -> (module, kernel, signature, meta); meta from the module's own ``meta`` (what ``launch`` uses),
    with two head groups and valid counts; the conv kernel also without valid counts (``-novc``, nvfp4),
    writing fp32 split partials (``-split``, each kind with rope); the conv and pair kernels also with their
    hand-offs through named barriers where that is not their default (``-named``: the pair kernel) and through
    mbarriers where it is (``-mbar``: the conv kernel, each kind with rope); one variant per kernel family that merges
    its splits in the kernel (``-fused``); the conv kernel's persistent grid (``-persist``)."""
    from sparsemla.kernels.sm90 import bf16, conv, few, wide
    from sparsemla.plan import cluster_builds
    v = {}
    for fid, (bpr, rope, rope_off, scale_off) in LAYOUTS.items():
        kind = fid.split("-")[0]
        if fid in ("bf16", "bf16-nope"):  # the pair kernel without its default gather (128 contiguous bytes of 4
            # rows), tile output and per-thread releases
            v[f"bf16-{fid}-plain"] = ("bf16", "bf16_kernel", SIG, bf16.meta(
                bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, num_groups=2, has_valid_counts=True,
                rows128=False, smem_out=False, thread_free=False))
        if fid in ("bf16", "bf16-nope"):  # conv's bf16 gather in 64 contiguous bytes of 8 rows (not its default)
            v[f"conv-{fid}-rows64"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=2, has_valid_counts=True, rows128=False))
        # conv's producer options (conv.TUNED gives each kind its defaults, which the plain variants below carry):
        # every option the kind does not take by default once, the others off (``-plain``: all off)
        producer = dict(l2_hint=False, early=False, late_next=False, lean_fences=False, idx_ahead=False,
                        early_idx=False, row_prefetch=False)
        for suffix, on in (("-plain", {}), ("-hint", dict(l2_hint=True)), ("-idx2", dict(idx_ahead=True)),
                           ("-early", dict(early=True, late_next=True, lean_fences=True))):
            if kind == "bf16" or fid != kind or (on and all(conv.TUNED[kind].get(o) for o in on)):
                continue
            v[f"conv-{fid}{suffix}"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=2, has_valid_counts=True, **dict(producer, **on)))
        if fid == "fp8_ds_mla":  # the diagnostic trace build (benchmarks/conv_trace.py)
            v[f"conv-{fid}-trace"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=2, has_valid_counts=True, trace=True))
        if fid == "bf16":  # the trace build of the persistent grid (prefill's plan), a row of stamps per item
            v[f"conv-{fid}-persist-trace"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=2, has_valid_counts=True, persist=True, trace=True))
        if fid == "fp8_ds_mla":  # a tile freed before the next ready wait, the indices early (not its default; its
            # row_prefetch off: the three together spill 48 bytes)
            v[f"conv-{fid}-ffei"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=2, has_valid_counts=True, free_first=True, early_idx=True, row_prefetch=False))
        if fid in ("fp8", "nvfp4_ds_mla", "fp8-nope"):  # the L2 prefetch of the next rows (not their default)
            v[f"conv-{fid}-pf"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=2, has_valid_counts=True, row_prefetch=True))
        if fid in ("fp8_ds_mla", "bf16"):  # the persistent grid (the plan's for bf16 rows; the converting producer)
            v[f"conv-{fid}-persist"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=2, has_valid_counts=True, persist=True))
        if fid in ("nvfp4_ds_mla-nope", "bf16"):  # idx_ahead for the NoPE rows' and bf16's producer
            v[f"conv-{fid}-idx2"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=2, has_valid_counts=True, idx_ahead=True))
        for name, (mod, f) in FUSED.items():
            if f == fid:
                args = dict(bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, num_groups=2,
                            has_valid_counts=True, fused=True)
                module = {"few": few, "conv": conv, "bf16": bf16}[mod]
                if mod != "bf16":
                    args.update(kind=kind, scale_offset=scale_off)
                v[name] = (mod, f"{mod}_kernel", SIG_SPLIT if mod == "bf16" else SIG_K_SPLIT, module.meta(**args))
        if kind == "bf16":
            # the pair kernel: mbarrier hand-offs by default (``-named``: the other); the conv kernel: named
            # barriers by default (``-mbar``: the other)
            for suffix, named in (("", False), ("-named", True)):
                if suffix and fid != kind:
                    continue
                v[f"bf16-{fid}{suffix}"] = ("bf16", "bf16_kernel", SIG, bf16.meta(
                    bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, num_groups=2, has_valid_counts=True,
                    named=named))
            for suffix, named in (("", None), ("-mbar", False)):
                if suffix and fid != kind:
                    continue
                v[f"conv-{fid}{suffix}"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                    kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                    num_groups=2, has_valid_counts=True, named=named))
            continue
        for mod, name in ((few, "few"), (wide, "wide")):
            for fp8_qk in (False, True):
                if kind not in mod.KINDS or (fp8_qk and kind == "nvfp4_ds_mla"):
                    continue
                v[f"{name}-{fid}" + ("-fp8qk" if fp8_qk else "")] = (name, f"{name}_kernel", SIG_K, mod.meta(
                    kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                    num_groups=2, has_valid_counts=True, fp8_qk=fp8_qk))
        # every layout with valid counts; without them and with split partials once per kind (the layout does
        # not change those paths, and each compile costs CI time on three releases)
        for suffix, sig, vc in (("", SIG_K, True), ("-novc", SIG_K, False), ("-split", SIG_K_SPLIT, True),
                                ("-mbar", SIG_K, True)):
            if suffix and (fid != kind or (suffix == "-novc" and kind != "nvfp4_ds_mla")):
                continue
            v[f"conv-{fid}{suffix}"] = ("conv", "conv_kernel", sig, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=2, has_valid_counts=vc, named=False if suffix == "-mbar" else None))
        if fid in ("fp8", "fp8_ds_mla", "fp8_ds_mla-nope", "nvfp4_ds_mla", "nvfp4_ds_mla-nope") and cluster_builds():
            v[f"conv-{fid}-cluster"] = ("conv", "conv_kernel", SIG_K, conv.meta(
                kind=kind, bytes_per_row=bpr, rope_dim=rope, rope_offset=rope_off, scale_offset=scale_off,
                num_groups=1, has_valid_counts=True, cluster=True))
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


def normalized_ptx(ptx: str) -> list:
    """The PTX instructions without comments, line info (``.loc`` / ``.file``, ``$L__tmp`` labels, debug
    sections) or the kernel's name: equal for two sources that differ only in names, comments and line
    numbers.  (ptxas schedules around the line-info labels, so such sources can still differ in SASS.)"""
    names = set(re.findall(r"\.entry\s+(\w+)\(", ptx))
    out = []
    for line in ptx.split(".section\t.debug")[0].splitlines():
        line = line.split("//")[0].strip()
        if not line or line.startswith((".loc", ".file")) or re.fullmatch(r"\$L__(tmp|func_begin|func_end)\d+:", line):
            continue
        for n in names:
            line = line.replace(n, "<fn>")
        out.append(re.sub(r"\s+", " ", line))
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

    mod, fn_name, sig, meta = VARIANTS[name]
    fn = getattr(importlib.import_module(f"sparsemla.kernels.sm90.{mod}"), fn_name)
    options = {k: meta[k] for k in ("num_warps", "maxnreg", "enable_fp_fusion", "num_ctas", "launch_cooperative_grid")
               if k in meta}
    cons = {k: v for k, v in meta.items() if k not in options}
    if fn_name == "conv_kernel":  # its last runtime argument: the work-item count
        sig = dict(sig, n_items="i32")
    sig = dict(sig, **{k: "constexpr" for k in cons})
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
        knobs.cache.dir = cache  # a fresh build, so that ptxas runs and its log is seen
        knobs.nvidia.dump_ptxas_log = True
        k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cons),
                           target=GPUTarget("cuda", 90, 32), options=options)
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
    return dict(sass_sha=hashlib.sha256("\n".join(ins).encode()).hexdigest()[:16],
                ptx_sha=hashlib.sha256("\n".join(normalized_ptx(k.asm["ptx"])).encode()).hexdigest()[:16],
                instructions=len(ins),
                regs=regs, stack=stack, smem=k.metadata.shared, setmaxnreg="setmaxnreg" in ptx,
                mbarrier_cp_async="cp.async.mbarrier.arrive.noinc" in ptx, serialized="serialized" in log,
                ops={op: counts[op] for op in sorted(counts)}, cluster=_cluster_protocol(ptx),
                grid_barrier=_grid_barrier(ptx), cooperative=bool(getattr(k.metadata, "launch_cooperative_grid", 0)),
                mbarrier_overlap=mbarrier_overlap(ptx), unused_mbarriers=unused_mbarriers(k.asm["ttgir"]))


def unused_mbarriers(ttgir: str) -> list:
    """The shared-memory buffers the TTGIR initializes as mbarriers (``ttng.init_barrier``) and uses in no other op:
    dead to Triton's allocator once initialized, which may place scratch over them (``mbarrier_overlap``)."""
    root = {}
    for dst, src in re.findall(r"(%[\w.]+) = ttg\.memdesc_(?:index|subslice|subview|reinterpret)\w* (%[\w.]+)", ttgir):
        root[dst] = root.get(src, src)
    inits, used = set(), set()
    for line in ttgir.splitlines():
        names = re.findall(r"%[\w.]+", line.split(" loc(")[0])
        if "ttng.init_barrier" in line:
            inits.add(root.get(names[0], names[0]))
        elif re.search(r"= ttg\.(local_alloc|memdesc_(index|subslice|subview|reinterpret))", line):
            continue
        else:
            used.update(root.get(n, n) for n in names)
    return sorted(inits - used)


def mbarrier_overlap(ptx: str) -> list:
    """The shared-memory offsets of initialized mbarriers that an ordinary shared load or store of the PTX also
    addresses as its constant offset (``[%r+N]`` or ``[global_smem+N]``, N the mbarrier's own: a scratch buffer
    placed there; Triton's warp-switch state, read at ``[%r+N+4]`` with the warp's id in ``%r``, lies past it).
    PTX wants an mbarrier's memory invalidated before any other use; Triton's allocator places scratch over an
    mbarrier that no partition uses once it is initialized, and such a kernel read its own row pointers back as
    the mbarrier's state."""
    base = set(re.findall(r"mov\.(?:b32|u32)\s+(%r\d+), global_smem;", ptx))
    reg_off = {}
    for dst, src, n in re.findall(r"add\.s32\s+(%r\d+), (%r\d+), (\d+);", ptx):
        if src in base:
            reg_off[dst] = int(n)
    inits = set()
    for target in re.findall(r"mbarrier\.init\S*\s+\[([^\]]+)\]", ptx):
        m = re.fullmatch(r"global_smem\+(\d+)", target.strip())
        if m:
            inits.add(int(m.group(1)))
        elif target.strip() in reg_off:
            inits.add(reg_off[target.strip()])
    touched = set()
    for line in ptx.splitlines():
        if "mbarrier" in line or not re.search(r"\b(ld|st)\.shared", line):
            continue
        for n in re.findall(r"\[(?:%r\d+|global_smem)\+(\d+)\]", line):
            touched.add(int(n))
    return sorted(inits & touched)


def _grid_barrier(ptx: str) -> dict:
    """The in-kernel merge's grid barrier in a FUSED variant's PTX: the fence and arrival of each program's thread
    0, the last arrival's release of the next generation, the others' acquiring loads of it; and the L2 loads
    (``ld.global.cg``) of the other programs' partials."""
    return dict(fence=ptx.count("fence.acq_rel.gpu"), arrive=ptx.count("atom.acq_rel.gpu.global.add.u32"),
                release=ptx.count("red.release.gpu.global.add.u32"),
                acquire=ptx.count("ld.acquire.gpu.global.u32"), cg_loads=ptx.count("ld.global.cg"))


def _cluster_protocol(ptx: str) -> dict:
    """What a 2-CTA kernel's PTX does across the cluster: its ``st.async`` stores, the CTA ranks its ``mapa``
    addresses (literal ranks), the byte counts its mbarriers expect, its mbarrier-init fences and cluster barriers."""
    ranks = re.findall(r"mapa\.shared::cluster\.u32\s+%r\d+, %r\d+, (\d+);", ptx)
    tx = re.findall(r"mbarrier\.arrive\.expect_tx\S*\s+_, \[%r\d+\], (\d+);", ptx)
    return dict(st_async=ptx.count("st.async"), mapa_ranks=sorted({int(r) for r in ranks}),
                expect_tx=sorted({int(n) for n in tx}),
                init_fence="fence.mbarrier_init.release.cluster" in ptx,
                cluster_barriers=ptx.count("barrier.cluster.wait"))


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
            print(f"{n:34s} ERROR {r['error'].splitlines()[0][:200]}")
        else:
            print(f"{n:34s} sass {r['sass_sha']} ptx {r['ptx_sha']} ins {r['instructions']:6d} regs {r['regs']:3d} stack {r['stack']:4d} "
                  f"smem {r['smem']:6d} setmaxnreg {int(r['setmaxnreg'])} cp.async-mbar {int(r['mbarrier_cp_async'])} "
                  f"serialized {int(r['serialized'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"triton": triton.__version__, "variants": out}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
