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

BF16_WIDE = """
@triton.jit
def _v_bf16_wide(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                 o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                 sm_scale_log2, H, K, rows_per_split, num_splits,
                 BPT: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                 NG: tl.constexpr, HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    D: tl.constexpr = 512 + ROPE
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    d = tl.arange(0, 512)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q = _bf16_operand(tl.load(q_row + d[None, :], mask=hm[:, None], other=0.0), INTERP)
    if ROPE:
        r = tl.arange(0, 64)
        qpe = _bf16_operand(tl.load(q_row + 512 + r[None, :], mask=hm[:, None], other=0.0), INTERP)
    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, 512], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, False)
        vmask = valid[:, None]
        rp = tl.multiple_of(kv_ptr.to(tl.pointer_type(tl.bfloat16)) + row * D, 16)
        kk = _bf16_operand(tl.load(rp[:, None] + d[None, :], mask=vmask, other=0.0), INTERP)
        sc = tl.dot(q, tl.trans(kk))
        if ROPE:
            kpe = _bf16_operand(tl.load(rp[:, None] + 512 + r[None, :], mask=vmask, other=0.0), INTERP)
            sc = tl.dot(qpe, tl.trans(kpe), sc)
        sc = tl.where(valid[None, :], sc * sm_scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        pc = _bf16_operand(p.to(tl.bfloat16), INTERP)
        acc = tl.dot(pc, kk, acc * alpha[:, None])
    inv_l, lse = _finish(l_i, m_i)
    _store_chunk(o_ptr, t, s, heads, hm, d, acc * inv_l[:, None], stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)

"""

# Many heads (wgmma): every K tile converted once, in natural dim order, to bf16 (fp8_ds_mla: tile scale
# applied; e4m3 and e2m1 x e4m3 are exact in bf16), then the bf16-wide structure (one 512-deep QK dot,
# one [HB, 512] accumulator, q in shared memory straight from its load).
CONV_WIDE = """
@triton.jit
def _v_fp8_wide(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                BPT: tl.constexpr, DS: tl.constexpr, STAGED: tl.constexpr, ROPE: tl.constexpr,
                HB: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    d = tl.arange(0, 512)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q = _bf16_operand(tl.load(q_row + d[None, :], mask=hm[:, None], other=0.0), INTERP)
    if ROPE:
        r = tl.arange(0, 64)
        qpe = _bf16_operand(tl.load(q_row + 512 + r[None, :], mask=hm[:, None], other=0.0), INTERP)
    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, 512], tl.float32)
    score_scale = sm_scale_log2
    if not DS:
        score_scale = score_scale * k_scale
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, STAGED)
        base = tl.multiple_of(kv_ptr + row * BPT, 16)
        vmask = valid[:, None]
        k8 = tl.load(base[:, None] + d[None, :], mask=vmask, other=0).to(tl.float8e4nv, bitcast=True)
        if DS:
            sp = (base + 512).to(tl.pointer_type(tl.float32))
            sc4 = tl.load(sp[:, None] + tl.arange(0, 4)[None, :], mask=vmask, other=0.0)
            scl = tl.reshape(tl.broadcast_to(sc4[:, :, None], [BN, 4, 128]), [BN, 512])
            kk = _bf16_operand((k8.to(tl.float32) * scl).to(tl.bfloat16), INTERP)
        else:
            kk = _bf16_operand(k8.to(tl.float16).to(tl.bfloat16), INTERP)
        sc = tl.dot(q, tl.trans(kk))
        if ROPE:
            if DS:
                kpe = tl.load((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + r[None, :], mask=vmask, other=0.0)
            else:
                kpe = tl.load(base[:, None] + 512 + r[None, :], mask=vmask, other=0).to(tl.float8e4nv, bitcast=True)
                kpe = kpe.to(tl.float16).to(tl.bfloat16)
            sc = tl.dot(qpe, tl.trans(_bf16_operand(kpe, INTERP)), sc)
        sc = tl.where(valid[None, :], sc * score_scale, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        pc = _bf16_operand(p.to(tl.bfloat16), INTERP)
        acc = tl.dot(pc, kk, acc * alpha[:, None])
    inv_l, lse = _finish(l_i, m_i)
    if not DS:
        inv_l = inv_l * k_scale
    _store_chunk(o_ptr, t, s, heads, hm, d, acc * inv_l[:, None], stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)

@triton.jit
def _v_nv_wide(q_ptr, stride_qt, stride_qh, kv_ptr, idx_ptr, stride_it, vc_ptr,
               o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
               sm_scale_log2, H, K, rows_per_split, num_splits,
               BPT: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
               NG: tl.constexpr, HAS_VC: tl.constexpr, INTERP: tl.constexpr):
    SCALE_OFF: tl.constexpr = 320 if ROPE else 256
    t, s, heads, hm, k_begin, k_end = _program_coords(H, K, vc_ptr, rows_per_split, num_splits, NG, HB, HAS_VC)
    d = tl.arange(0, 512)
    c256 = tl.arange(0, 256)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q = _bf16_operand(tl.load(q_row + d[None, :], mask=hm[:, None], other=0.0), INTERP)
    if ROPE:
        r = tl.arange(0, 64)
        qpe = _bf16_operand(tl.load(q_row + 512 + r[None, :], mask=hm[:, None], other=0.0), INTERP)
    blk = tl.arange(0, 32)
    sc_off = SCALE_OFF + 8 * (blk % 4) + blk // 4
    m_i = tl.full([HB], _NEG_BIG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, 512], tl.float32)
    for k0 in range(k_begin, k_end, BN):
        row, valid = _tile_rows(idx_ptr, t, stride_it, k0, k_end, K, BN, False)
        base = tl.multiple_of(kv_ptr + row * BPT, 16)
        vmask = valid[:, None]
        b8 = tl.load(base[:, None] + c256[None, :], mask=vmask, other=0).to(tl.int32)
        kf = tl.reshape(tl.join(_e2m1_to_fp16(b8 & 15), _e2m1_to_fp16(b8 >> 4)), [BN, 512])
        sf = tl.load((base[:, None] + sc_off[None, :]).to(tl.pointer_type(tl.float8e4nv)), mask=vmask,
                     other=0.0).to(tl.float16)
        sf = tl.reshape(tl.broadcast_to(sf[:, :, None], [BN, 32, 16]), [BN, 512])
        kk = _bf16_operand((kf * sf).to(tl.bfloat16), INTERP)
        sc = tl.dot(q, tl.trans(kk))
        if ROPE:
            kpe = tl.load(base[:, None] + 256 + r[None, :], mask=vmask, other=0).to(tl.float8e4nv, bitcast=True)
            sc = tl.dot(qpe, tl.trans(_bf16_operand(kpe.to(tl.float16).to(tl.bfloat16), INTERP)), sc)
        sc = tl.where(valid[None, :], sc * sm_scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        pc = _bf16_operand(p.to(tl.bfloat16), INTERP)
        acc = tl.dot(pc, kk, acc * alpha[:, None])
    inv_l, lse = _finish(l_i, m_i)
    _store_chunk(o_ptr, t, s, heads, hm, d, acc * inv_l[:, None], stride_ot, stride_os, stride_oh)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=hm)

"""


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
    a = v.index("        sf = tl.load(")
    b = v.index("[BN, 128])\n", a) + len("[BN, 128])\n")
    v = v[:a] + v[b:]
    out["diag-nv-noscale"] = v
    # every K tile converted once: the packed conversions made impure, so Triton cannot clone them per
    # dot operand (it then converts once and moves the fp16 tile through shared memory for each dot)
    out["impure-fp8"] = fp8.replace("_fwd_fp8_kernel", "_v_impure_fp8")
    out["impure-nv"] = nv.replace("_fwd_nvfp4_kernel", "_v_impure_nv")
    out["bf16-wide"] = BF16_WIDE
    a = CONV_WIDE.index("@triton.jit\ndef _v_nv_wide")
    out["fp8-wide"] = CONV_WIDE[:a]
    out["nv-wide"] = CONV_WIDE[a:]
    header = src[:src.index("# --------------------------------------------------------------------------------------------------------\n# fp8 family")]
    mods = {}
    d = tempfile.mkdtemp(prefix="smla_variants_")
    for name, body in out.items():
        path = os.path.join(d, name.replace("-", "_") + ".py")
        helpers = _section(src, "@triton.jit\ndef _fp8_group") + _section(src, "@triton.jit\ndef _bf16_operand")
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
