"""Compile-only probe: does Triton 3.6's Hopper warp-specialization pass partition a dense attention loop
whose K tiles come from TMA tensor descriptors (what a dense-prefill shortcut over whole 64-token blocks
could use)?"""
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget


@triton.jit
def _dense_ws(q_ptr, kv_ptr, o_ptr, n_rows, T, WS: tl.constexpr, BN: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, 64)
    d = tl.arange(0, 512)
    q = tl.load(q_ptr + t * 64 * 512 + h[:, None] * 512 + d[None, :])
    desc = tl.make_tensor_descriptor(kv_ptr, shape=[n_rows, 512], strides=[512, 1], block_shape=[BN, 512])
    m_i = tl.full([64], -1e30, tl.float32)
    l_i = tl.zeros([64], tl.float32)
    acc = tl.zeros([64, 512], tl.float32)
    for k0 in tl.range(0, n_rows, BN, warp_specialize=WS):
        k = desc.load([k0, 0])
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), k, acc * alpha[:, None])
        m_i = m_new
    tl.store(o_ptr + t * 64 * 512 + h[:, None] * 512 + d[None, :], acc / l_i[:, None])


for ws in (False, True):
    src = triton.compiler.ASTSource(fn=_dense_ws, signature={"q_ptr": "*bf16", "kv_ptr": "*bf16", "o_ptr": "*fp32",
                                                              "n_rows": "i32", "T": "i32", "WS": "constexpr", "BN": "constexpr"},
                                    constexprs={"WS": ws, "BN": 64})
    try:
        cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})
        ir = cc.asm["ttgir"]
        print("WS", ws, "compiled; warp_specialize ops:", ir.count("ttg.warp_specialize"), "partitions:",
              ir.count("partition"), "tma loads:", ir.count("async_tma_copy"), "smem", cc.metadata.shared)
    except Exception as e:
        print("WS", ws, "failed:", type(e).__name__, str(e)[:400])
