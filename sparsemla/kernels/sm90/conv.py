"""sm_90 sparse MLA decode for quantized rows (``fp8``, ``fp8_ds_mla``, ``nvfp4_ds_mla``; RoPE or NoPE) at 64
heads per program, with a converting producer (Gluon, warp-specialized); bf16 rows the same way, the producer
copying them into the tiles by cp.async (no conversion: ``B16``).

The other quantized kernels (``few.py``, ``wide.py``) convert the raw bytes in the MMA warpgroups' registers,
once per head group and operand; at 64-128 heads their tensor cores then idle most of the time.  Here the
conversion has its own warpgroup and the MMA warpgroups run the bf16 kernel's kind of loop on converted tiles:

- producer (worker partition, 4 warps): stages q; per 64-row block, gathers the raw rows as 32-bit words (16
  bytes a thread and row) in 128-dim pieces, two pieces ahead of the one it converts (docs/design/kernels.md),
  dequantizes each piece and stores it into the block's tile (kL:
  dims 0-255, kR: 256-511, kE: the rope), two tiles double-buffered, and the block's row validity into sV[b].
  Rows of -1 / past the valid count are never read and their tile rows are zeros (so that P = 0 times them
  stays 0);
- warpgroup 0 (default partition): S = q K^T over all 576 (512) dims for 64 heads x 64 rows (wgmma m64n64,
  q and the tile from shared memory), masked with sV[b] (from shared memory: a global load of the indices in
  this serial chain, and its registers, cost 15-25 %), the online softmax (base 2), publishes P (in the tiles'
  16-bit type) and the rescale factor alpha for warpgroup 1, and PV for output columns 0-255 with P from shared
  memory too (P in registers needs 208 registers, which leave the others too few; V = kL read as the MMA's B
  operand, MN-major: no transpose).  The next block's QK is issued behind this block's PV;
- warpgroup 1 (worker partition): PV for output columns 256-511 (A = P from shared memory, B = kR), its
  accumulator rescaled by warpgroup 0's alpha.

After the last block each warpgroup writes a bf16 output through tile 0 of the part it alone read (kL / kR) and out
in 16-byte row stores (``smem_out``); bf16 rows free each tile once warpgroup 0's PV on it is done, before the wait
for the next block (``free_first``), so that the producer's next copies into it start a block earlier.

Values.  The tiles, q and P are fp16 where the row values are exact in it, bf16 otherwise.  fp8: e4m3 -> fp16
(exact); the per-tensor k_scale multiplies the scores and the output.  nvfp4_ds_mla: e2m1 x the 16-dim block's
e4m3 scale (exact in fp16, ``rows.fp4_words_f16``); the e4m3 rope -> fp16.  For these two q is converted to fp16
by the producer, each head times a power of two that keeps it in fp16's range (undone on its scores).
fp8_ds_mla: e4m3 x the 128-dim group's fp32 scale, rounded to bf16 (exact for the power-of-two scales the
writers produce; other scales round once, like a bf16 cache; fp16 could overflow); the bf16 rope and q are
copied.  Converting to fp16 saves a third of the producer's instructions against bf16 (no detour through
fp32), measured in SASS: about 800 against 1230 a thread and block for nvfp4.

mbarriers: ``q_bar`` (q staged: one cp.async arrival per producer thread; fp16 q: the producer's
``common.publish``), ``ready[b]`` (tile b and sV[b]; the producer fences its generic-proxy stores for the async
proxy first), ``free[b]`` (count 2: both warpgroups done reading tile b; warpgroup 0 arrives when its PV of the
block is done, before the next block's QK is), ``p_ready`` / ``p_free`` (P and alpha handed from warpgroup 0 to
warpgroup 1), ``l_bar`` (warpgroup 0's final row sums, through ``common.publish``, so that both halves of the
output are normalized by the same l).

Shared memory: q 72 KB + 2 tiles x 72 KB + P 8 KB + small vectors, 231,120 bytes of the 232,448 an SM gives a
block (NoPE 206,512: no rope buffers).  Registers: 168 at launch for 12 warps; warpgroup 0 gets 208 (O 128 +
S 32 + the next QK), warpgroup 1 160, the producer 136 (bf16 rows: the producer 40, warpgroup 0 256).

``NAMED`` (``meta(named=True)``; every kind's default, :data:`TUNED`): P and alpha go from warpgroup 0 to
warpgroup 1 through two named hardware barriers (``bar.arrive`` / ``bar.sync`` on ids 14 and 15, 256 threads) instead
of the ``p_ready`` / ``p_free`` mbarriers, FlashInfer's hand-off: no try-wait loops and one warpgroup barrier less a
block in warpgroup 0.  On Triton 3.9 the mbarrier hand-off makes ptxas build warpgroup 0's wgmma descriptors ahead
and spill them (120-136 bytes of stack; named: none, fp8_ds_mla 24): decode b 128 on an H100 ran 0-14 % faster
with it on 3.9 and 0-2 % faster on 3.6 (docs/design/kernels.md).  bf16 rows (no spill either way): prefill 2-5 % and
decode at 128 heads 2 % faster with it on an H100 (Triton 3.6), 64 heads the same.

``CL`` (``meta(cluster=True)``; plan kernel ``sm90-cluster``, Triton >= 3.8, quantized rows, 65-128 heads): a
cluster of two CTAs serves a token's 128 heads, 64 each, and each CTA's producer converts 32 of every block's 64
rows into both CTAs' tiles by ``st.async`` (``_convert_blocks_cl``), so that a token's rows are converted once, not
once per 64 heads; docs/design/kernels.md has the protocol.

Gluon kernels do not run under the Triton interpreter: ``tests/test_sm90_compile.py`` compiles every variant
for sm_90 on the CPU; ``tests/gpu/test_sm90_conv_gpu.py`` checks the numbers against the float64 reference.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ...plan import triton_release
from . import compat
from .common import (NEG_BIG, PER_THREAD, PUBLISH, combine_in_kernel, fused_meta, named_asm, named_barrier,
                     normalizer, item_coords, publish, store_via_tile, valid_rows)
from .rows import L_ROWS128, block_indices, copy_rows, e4m3_words_bf16, e4m3_words_f16, fp4_words_f16, pow2_scale

# HINT's load of a thread's 4 consecutive words (pack 4: the first of its 4 addresses): FlashMLA's gather hint
NC_LOAD = gl.constexpr("ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4];")
# TRACE (a diagnostic variant): each partition's thread 0 writes the SM clock at named events into
# trace[item, event, block] (int64, the final-out pointer's bytes); blocks past TRACE_BLOCKS are not written
TRACE_BLOCKS = gl.constexpr(64)
TRACE_EVENTS = gl.constexpr(18)
# events: the producer's (0: its free wait returned, 1: before its ready arrival, 2: start, 3: q staged),
# warpgroup 0's (4: QK done, 5: P handed over, 6: before its ready wait, 7: after it, 8: PV done, 9: start,
# 10: end), warpgroup 1's (11: P received, 12: PV done, 13: its ready wait returned), the producer's fence
# (14: before it, 15: after it), the producer's next rows looked up (16) and its free wait begun (17)
# warpgroup 0's S [64 heads, 64 rows] and each warpgroup's O [64 heads, 256 columns] on wgmma
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
P_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
SROW = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))  # one value per head (of S)
SCOL = gl.constexpr(gl.SliceLayout(0, S_LAYOUT.value))  # one value per cache row of the block
OROW = gl.constexpr(gl.SliceLayout(1, O_LAYOUT.value))  # one value per head (of O)
# P and alpha between the two MMA warpgroups through named hardware barriers (NAMED; both warpgroups, 256 threads):
# the writer arrives on "P ready" without waiting and the reader syncs on it; the reader arrives on "P free" when
# its MMA has read them and the writer syncs on it before the next
P_READY_ARRIVE = named_asm("arrive", 14)
P_READY_SYNC = named_asm("sync", 14)
P_FREE_ARRIVE = named_asm("arrive", 15)
P_FREE_SYNC = named_asm("sync", 15)

# setmaxnreg of warpgroup 1 and the producer; warpgroup 0 gets the rest of 12 warps x 168, 208.  Below 160
# warpgroup 1 and below 192 warpgroup 0 make ptxas serialize the wgmma pipeline (C7512); a producer below 136
# spills its pieces.  The producer at 136 leaves warpgroup 0 the 208 registers it needs on every Triton release:
# at 192, Triton 3.8 and 3.9 spill in its main loop (30-33 local stores) and decode runs 1.06-1.40x slower than on
# 3.6 (docs/design/kernels.md has the A/B per release).
WG1_REGS = gl.constexpr(160)
PRODUCER_REGS = gl.constexpr(136)
PS_PRODUCER_REGS = gl.constexpr(144)
# bf16 rows: the producer only copies (cp.async, as sm90-bf16's producer), so it needs few registers and
# warpgroup 0 gets 256
B16_PRODUCER_REGS = gl.constexpr(40)

# Producer register layouts (4 warps): the raw rows are loaded as 32-bit words, 16 contiguous bytes a thread
# per row (as bytes, the values carried from one block to the next would take a register each).  For
# fp8_ds_mla and nvfp4 rows the lanes run along the rows first (order [0, 1]: L_W8R, L_W2): the 8 lanes of a
# quarter-warp hold the same columns of 8 consecutive rows, which the tiles' 128-byte swizzle puts on 8
# different 16-byte bank groups, so each 16-byte store of a converted piece is conflict-free (lanes along a row
# put two lanes of a quarter-warp on the same banks).  Measured on the H200, 64 / 128 heads, one process:
# nvfp4 128 / 242 -> 119 / 224 us, fp8_ds_mla 142 / 266 -> 138 / 256.  Plain fp8 rows were slower that way
# (114 / 215 -> 128 / 245 us, from the layout of their separately read e4m3 rope), so they keep lanes along the
# row (L_W8, L_W2C).
# e4m3 piece [64 rows, 32 words = 128 dims]: plain fp8 L_W8 (4 rows a thread), fp8_ds_mla L_W8R (2 rows x 8
# words a thread)
L_W8 = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))
L_W8R = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [0, 1]))
# e2m1 piece [64 rows, 16 words = 128 dims] (2 rows a thread), the same words as [64, 8 blocks, 2]; its e4m3
# rope [64, 16 words] alike; plain fp8's e4m3 rope in L_W2C
L_W2 = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [0, 1]))
L_W2B = gl.constexpr(gl.BlockedLayout([1, 2, 2], [8, 4, 1], [4, 1, 1], [2, 0, 1]))
L_W2C = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
L_W2S = gl.constexpr(gl.SliceLayout(2, L_W2B.value))  # the e4m3 block scales [64 rows, 8 blocks]
# bf16 q rows [64, 64k elements] (8 elements a thread)
L_B16 = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))
# fp8_ds_mla's bf16 rope [64 rows, 64] (8 elements a thread, the rows of L_W8R): copied by cp.async
L_B16R = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [0, 1]))

# CL (``meta(cluster=True)``; Triton >= 3.8): a cluster of two CTAs serves one token's 128 heads, 64 each, and
# each CTA's producer converts half of every block's rows into both CTAs' tiles.  In Gluon's cluster model one
# program spans both CTAs: a tensor of the program is split over them ("split": CTA c holds the second half of
# dim 0 when c = 1) or held whole by each ("whole").  q, S, P, O and the per-head vectors are split on the heads;
# the tiles and the row validity are whole (every CTA's MMAs read all 64 rows); the producer's rows are split.


@gluon.constexpr_function
def cga(layout, cl, split=True):
    """``layout`` as the CL kernel needs it: split over the cluster's two CTAs on dim 0 (``split``) or held whole
    by each CTA; ``layout`` itself where ``cl`` is False (one CTA: the layouts the default kernel is built with)."""
    cl = getattr(cl, "value", cl)
    layout = getattr(layout, "value", layout)
    if not cl:
        return layout
    bases = [[int(split and d == 0) for d in range(len(layout.warps_per_cta))]]
    if isinstance(layout, gl.NVMMADistributedLayout):
        return gl.NVMMADistributedLayout(version=layout.version, warps_per_cta=layout.warps_per_cta,
                                         instr_shape=layout.instr_shape, cga_layout=bases)
    return gl.BlockedLayout(layout.size_per_thread, layout.threads_per_warp, layout.warps_per_cta, layout.order,
                            cga_layout=bases)


@gluon.constexpr_function
def head_groups(cl):
    """Head groups of 64 in one program: 2 for the CL kernel (one per CTA), else 1."""
    return 2 if getattr(cl, "value", cl) else 1


# The producer's converted piece [64 rows, 64 words] for both CTAs' tiles at once: [2 (destination CTA), 64, 64],
# the rows split over the CTAs, each thread holding its values for both destinations (the same registers);
# V2_CL is its slice, the layout e4m3_words_bf16 gives for L_W8R's words (so converting to it moves nothing).
V3_CL = gl.constexpr(gl.BlockedLayout([2, 1, 8], [1, 8, 4], [1, 4, 1], [1, 2, 0], cga_layout=[[0, 1, 0]]))
# the same for fp4_words_f16's words (16 a thread) and for e4m3_words_f16's of plain fp8's pieces and rope (L_W8's
# and L_W2C's lanes along the row); nvfp4's e4m3 rope has V3_CL's
V3_FP4 = gl.constexpr(gl.BlockedLayout([2, 1, 16], [1, 8, 4], [1, 4, 1], [1, 2, 0], cga_layout=[[0, 1, 0]]))
V3_F8 = gl.constexpr(gl.BlockedLayout([2, 1, 8], [1, 4, 8], [1, 4, 1], [2, 1, 0], cga_layout=[[0, 1, 0]]))
V3_F8R = gl.constexpr(gl.BlockedLayout([2, 1, 8], [1, 8, 4], [1, 4, 1], [2, 1, 0], cga_layout=[[0, 1, 0]]))
# the consumers' signal that they are done with a tile: SIG_N words from each warpgroup to both CTAs
SIG_CL = gl.constexpr(gl.BlockedLayout([2, 1, 1], [1, 1, 32], [1, 1, 4], [2, 1, 0], cga_layout=[[0, 1, 0]]))
SIG_N = gl.constexpr(2)  # int32 values per (destination, source CTA) in a signal
# what each CTA's free[b] receives a block: two warpgroups x two CTAs x SIG_N words
SIG_BYTES = gl.constexpr(2 * 2 * SIG_N.value * 4)


@gluon.jit
def _ptrs(idx, kv_ptr, BPT: gl.constexpr):
    """Byte pointers to the cache rows ``idx`` (row 0 for an invalid entry: never read) and which are valid."""
    valid = idx >= 0
    return gl.multiple_of(kv_ptr + gl.where(valid, idx, 0).to(gl.int64) * BPT, 16), valid


@gluon.jit
def _words(base, valid, off: gl.constexpr, N: gl.constexpr, lay: gl.constexpr, HINT: gl.constexpr = False):
    """N 32-bit words at byte ``off`` of the rows ``base`` [64] (SliceLayout(1, lay)), zeros for invalid rows.
    HINT: 16-byte loads through the read-only path with a 256-byte L2 prefetch and no L1 allocation
    (``NC_LOAD``; an invalid row reads row 0, which the caller's pointers give it, and is zeroed)."""
    c = gl.arange(0, N, layout=gl.SliceLayout(0, lay))
    p = gl.multiple_of(base + off, 16).to(gl.pointer_type(gl.int32))
    if HINT:
        addr = (p[:, None] + c[None, :]).to(gl.int64, bitcast=True)
        w = gl.inline_asm_elementwise(NC_LOAD, "=r,=r,=r,=r,l,l,l,l", [addr], gl.int32, True, 4)
        return gl.where(valid[:, None], w, 0)
    return gl.load(p[:, None] + c[None, :], mask=valid[:, None], other=0)


@gluon.jit
def _load_piece(base, valid, P: gl.constexpr, SCALE_OFF: gl.constexpr, DS: gl.constexpr, FP4: gl.constexpr,
                CL: gl.constexpr = False, HINT: gl.constexpr = False):
    """Raw words of 128-dim piece P of 64 rows and their scales, zeros for invalid rows: e4m3 [64, 32] (L_W8R
    for fp8_ds_mla, L_W8 for plain fp8) and, fp8_ds_mla, the group scale [64] fp32; nvfp4 [64, 16] (L_W2) and
    the 8 block scales [64, 8] u8 (L_W2S).  Plain fp8: the scale is 0 (unused)."""
    if FP4:
        raw = _words(base, valid, 64 * P, 16, cga(L_W2, CL), HINT)
        # block 8 P + j of a row: its scale byte is at 8 (j % 4) + 2 P + j // 4 (kv-formats.md)
        l_w2s: gl.constexpr = gl.SliceLayout(2, cga(L_W2B, CL))
        sl: gl.constexpr = gl.SliceLayout(1, l_w2s)
        j = gl.arange(0, 8, layout=gl.SliceLayout(0, l_w2s))
        so = SCALE_OFF + 2 * P + 8 * (j % 4) + j // 4
        sbase = gl.convert_layout(base, sl)  # the same rows in each thread
        sc = gl.load(sbase[:, None] + so[None, :], mask=gl.convert_layout(valid, sl)[:, None], other=0)
    else:
        if DS:
            raw = _words(base, valid, 128 * P, 32, cga(L_W8R, CL), HINT)
            sc = gl.load((base + (SCALE_OFF + 4 * P)).to(gl.pointer_type(gl.float32)), mask=valid, other=0.0)
        else:
            raw = _words(base, valid, 128 * P, 32, cga(L_W8, CL), HINT)
            sc = 0.0
    return raw, sc


@gluon.jit
def _store_piece(raw, sc, dst, DS: gl.constexpr, FP4: gl.constexpr):
    """Dequantize a piece (``_load_piece``) and store it into ``dst`` [64, 64] int32 (pairs of the tile's
    16-bit type: a tile slice)."""
    if FP4:
        v = fp4_words_f16(gl.convert_layout(raw.reshape([64, 8, 2]), L_W2B), sc)  # the same registers
    elif DS:
        v = e4m3_words_bf16(raw, gl.broadcast(sc[:, None], raw)[0])
    else:
        v = e4m3_words_f16(raw)
    dst.store(v)


@gluon.jit
def _load_rope(base, valid, ROPE_OFF: gl.constexpr, FP4: gl.constexpr, CL: gl.constexpr = False,
               HINT: gl.constexpr = False):
    """The e4m3 rope of 64 rows as words [64, 16] (nvfp4 L_W2, fp8 L_W2C), zeros for invalid rows.  ``base`` in
    the layout of the value pieces (nvfp4) or of L_W2C (fp8).  fp8_ds_mla's bf16 rope: ``_copy_rope_bf16``."""
    if FP4:
        return _words(base, valid, ROPE_OFF, 16, cga(L_W2, CL), HINT)
    else:
        return _words(base, valid, ROPE_OFF, 16, cga(L_W2C, CL), HINT)


@gluon.jit
def _copy_rope_bf16(dst, base, valid, ROPE_OFF: gl.constexpr, CL: gl.constexpr = False):
    """cp.async of fp8_ds_mla's bf16 rope of the rows ``base`` into ``dst`` [64, 64] bf16 (zeros for invalid
    rows): the values need no conversion, so they need not pass through registers.  CL: each CTA copies all 64
    rows into its own tile (``base`` whole)."""
    lay: gl.constexpr = cga(L_B16R, CL, False)
    sl: gl.constexpr = gl.SliceLayout(1, lay)
    rows = gl.multiple_of(gl.convert_layout(base, sl) + ROPE_OFF, 16).to(gl.pointer_type(gl.bfloat16))
    copy_rows(dst, rows, 0, 64, gl.convert_layout(valid, sl), lay)
    async_copy.commit_group()


@gluon.jit
def _send(v, dst, bar, V3: gl.constexpr):
    """CL: this CTA's rows of converted words ``v`` [64, N] into ``dst`` [2 destination CTAs, 64, N] -- both CTAs'
    tiles -- by ``st.async``, which counts the bytes on each CTA's ``bar``.  ``V3``: the layout whose dim-0 slice
    ``v`` has (the converted words as they come; converting to it moves nothing)."""
    v = gl.convert_layout(v, gl.SliceLayout(0, V3))
    compat.async_store(dst, gl.expand_dims(v, 0) + gl.zeros(dst.shape, gl.int32, V3), bar)  # the same registers


@gluon.jit
def _send_piece(raw, sc, kLc, kRc, b, P: gl.constexpr, bar, DS: gl.constexpr, FP4: gl.constexpr):
    """CL: dequantize this CTA's rows of piece P (``_load_piece``) and send them into tile b of both CTAs
    (``_send``).  ``kLc`` / ``kRc``: the tiles as words [2 tiles, 2 destination CTAs, 64, 128]."""
    dst = _piece_dst(kLc, kRc, b, P, 2)
    if FP4:
        _send(fp4_words_f16(gl.convert_layout(raw.reshape([64, 8, 2]), cga(L_W2B, True)), sc), dst, bar, V3_FP4)
    elif DS:
        _send(e4m3_words_bf16(raw, gl.broadcast(sc[:, None], raw)[0]), dst, bar, V3_CL)
    else:
        _send(e4m3_words_f16(raw), dst, bar, V3_F8)


@gluon.jit
def _signal(sig, bar):
    """CL: one warpgroup tells both CTAs' producers that it is done with a tile: ``SIG_N`` words into each CTA's
    ``sig`` [2 destination CTAs, 2 source CTAs, SIG_N] by ``st.async`` on each CTA's ``bar`` (the tile's ``free``,
    which expects SIG_BYTES from the four warpgroups of the cluster).  Call it after a warpgroup barrier."""
    compat.async_store(sig, gl.full([2, 2, SIG_N], 1, gl.int32, SIG_CL), bar)


@gluon.jit
def _convert_blocks_cl(idx_row, k_begin, k_end, n_blocks, kv_ptr, kLc, kRc, kE, sV, ready, free, BPT: gl.constexpr,
                       ROPE: gl.constexpr, SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, DS: gl.constexpr,
                       FP4: gl.constexpr):
    """CL: the producer's loop of the default kernel over this CTA's 32 rows of each block (two pieces ahead), each
    converted piece sent into both CTAs' tiles by ``st.async`` (``_send``), and so the e4m3 rope of nvfp4 and fp8
    rows; fp8_ds_mla's bf16 rope each CTA copies itself for all 64 rows (cp.async into its own tile), and each CTA
    stores the validity of all 64 rows.  ``ready[b]``: this producer's arrival (after its rope copies and validity
    stores) and the tile's bytes from both producers.  ``free[b]``: the producer's arrival and the four consumer
    warpgroups' signals (``_signal``), waited for before a tile is written again -- and at the end, so that no signal
    is still on its way to this CTA when it exits.  ``kE``: fp8_ds_mla's bf16 rope tiles, else the rope tiles as
    words [2 tiles, 2 destination CTAs, 64, 32]."""
    if FP4:
        rl: gl.constexpr = gl.SliceLayout(1, cga(L_W2, True))  # this CTA's rows
    elif DS:
        rl: gl.constexpr = gl.SliceLayout(1, cga(L_W8R, True))
    else:
        rl: gl.constexpr = gl.SliceLayout(1, cga(L_W8, True))
    el: gl.constexpr = gl.SliceLayout(1, cga(L_B16R, True, False))  # all 64 rows
    sl: gl.constexpr = gl.SliceLayout(1, cga(L_W2C, True))  # this CTA's rows for plain fp8's rope
    SEP: gl.constexpr = ROPE and not DS and not FP4  # a rope in its own layout
    if ROPE and not DS:
        TILE_BYTES: gl.constexpr = 64 * 576 * 2  # the tile, 16-bit values
    else:
        TILE_BYTES: gl.constexpr = 64 * 512 * 2  # kL and kR (fp8_ds_mla's rope is each CTA's own copy)
    base, valid = _ptrs(block_indices(idx_row, k_begin, k_end, rl), kv_ptr, BPT)
    raw, sc = _load_piece(base, valid, 0, SCALE_OFF, DS, FP4, True)
    raw1, sc1 = _load_piece(base, valid, 1, SCALE_OFF, DS, FP4, True)
    for i in range(n_blocks):
        b = i % 2
        nbase, nvalid = _ptrs(block_indices(idx_row, k_begin + (i + 1) * 64, k_end, rl), kv_ptr, BPT)
        ebase, evalid = _ptrs(block_indices(idx_row, k_begin + i * 64, k_end, el), kv_ptr, BPT)
        raw2, sc2 = _load_piece(base, valid, 2, SCALE_OFF, DS, FP4, True)
        if i >= 2:  # both CTAs' consumers are done with block i - 2 in this tile
            mbarrier.expect(free.index(b), SIG_BYTES)
            mbarrier.wait(free.index(b), ((i // 2) & 1) ^ 1)
        if ROPE and DS:
            _copy_rope_bf16(kE.index(b), ebase, evalid, ROPE_OFF, True)
        sV.index(b).store(evalid.to(gl.float32))
        _send_piece(raw, sc, kLc, kRc, b, 0, ready.index(b), DS, FP4)
        raw3, sc3 = _load_piece(base, valid, 3, SCALE_OFF, DS, FP4, True)
        _send_piece(raw1, sc1, kLc, kRc, b, 1, ready.index(b), DS, FP4)
        if ROPE and not DS:
            if SEP:
                rope = _load_rope(*_ptrs(block_indices(idx_row, k_begin + i * 64, k_end, sl), kv_ptr, BPT), ROPE_OFF,
                                  FP4, True)
            else:
                rope = _load_rope(base, valid, ROPE_OFF, FP4, True)
        raw, sc = _load_piece(nbase, nvalid, 0, SCALE_OFF, DS, FP4, True)
        _send_piece(raw2, sc2, kLc, kRc, b, 2, ready.index(b), DS, FP4)
        raw1, sc1 = _load_piece(nbase, nvalid, 1, SCALE_OFF, DS, FP4, True)
        _send_piece(raw3, sc3, kLc, kRc, b, 3, ready.index(b), DS, FP4)
        if ROPE and not DS:
            if SEP:
                _send(e4m3_words_f16(rope), kE.index(b), ready.index(b), V3_F8R)
            else:
                _send(e4m3_words_f16(rope), kE.index(b), ready.index(b), V3_CL)
        base = nbase
        valid = nvalid
        if ROPE and DS:
            async_copy.wait_group(0)  # this thread's rope copies have landed
            fence_async_shared()  # the rope -> the consumers' wgmma (async proxy)
        compat.barrier()  # every producer thread has copied its rope and stored its validity
        mbarrier.expect(ready.index(b), TILE_BYTES)
    for i in range(gl.maximum(n_blocks - 2, 0), n_blocks):
        b = i % 2
        mbarrier.expect(free.index(b), SIG_BYTES)
        mbarrier.wait(free.index(b), (i // 2) & 1)


@gluon.jit
def _store_rope(r, dst):
    """e4m3 rope words (``_load_rope``) into ``dst`` [64, 32] int32 (pairs of fp16 values)."""
    dst.store(e4m3_words_f16(r))


@gluon.jit
def _piece_dst(kLw, kRw, b, P: gl.constexpr, DIM: gl.constexpr = 1):
    """Tile b's dims 128 P .. 128 P + 127 as pairs of 16-bit values (kL: pieces 0, 1; kR: pieces 2, 3); the word
    dim is ``DIM`` of a tile (2 in CL's [2 destination CTAs, 64, 128] views)."""
    if P < 2:
        return kLw.index(b).slice(64 * P, 64, dim=DIM)
    else:
        return kRw.index(b).slice(64 * (P - 2), 64, dim=DIM)


@gluon.jit
def _stage_q_f16(q_row, qe_row, hm, qL, qR, qE, sQ, ROPE: gl.constexpr, CL: gl.constexpr = False):
    """q rows [64 heads] (bf16; the rope part at ``qe_row``) -> fp16 in qL / qR / qE, each head times a power of
    two c (its amax x c in
    [2^14, 2^15): no overflow, and bf16's 8 significant bits stay exact down to 2^-22 of the amax), and 1 / c
    into sQ.  Two passes over q (the second from L1 / L2): the amax, then the scaled values."""
    amax = gl.zeros([64 * head_groups(CL)], gl.float32, gl.SliceLayout(1, cga(L_B16, CL)))
    for j in gl.static_range(4):
        amax = gl.maximum(amax, gl.max(gl.abs(_q_part(q_row, hm, 128 * j, 128, False, CL)), 1))
    if ROPE:
        amax = gl.maximum(amax, gl.max(gl.abs(_q_part(qe_row, hm, 0, 64, False, CL)), 1))
    c, inv_c = pow2_scale(amax)  # amax c in [128, 256)
    c = c * 128.0
    for j in gl.static_range(2):
        qL.index(0).slice(128 * j, 128, dim=1).store(
            (_q_part(q_row, hm, 128 * j, 128, True, CL) * c[:, None]).to(gl.float16))
        qR.index(0).slice(128 * j, 128, dim=1).store(
            (_q_part(q_row, hm, 256 + 128 * j, 128, True, CL) * c[:, None]).to(gl.float16))
    if ROPE:
        qE.index(0).store((_q_part(qe_row, hm, 0, 64, True, CL) * c[:, None]).to(gl.float16))
    sQ.store(inv_c * 0.0078125)


@gluon.jit
def _q_part(q_row, hm, col0: gl.constexpr, N: gl.constexpr, AGAIN: gl.constexpr = False, CL: gl.constexpr = False):
    """q[:, col0 : col0 + N] of the rows ``q_row`` as fp32 [64, N] (L_B16; zeros for rows not in ``hm``).
    AGAIN: the second read of the same elements, volatile so that the compiler cannot keep the first read's
    values live instead (all of q: 288 values a thread)."""
    c = gl.arange(0, N, layout=gl.SliceLayout(0, cga(L_B16, CL)))
    return gl.load(q_row[:, None] + col0 + c[None, :], mask=hm[:, None], other=0.0, volatile=AGAIN).to(gl.float32)


@gluon.jit
def _prefetch_rows_l2(row, n):
    """EARLY_IDX: ``prefetch.global.L2`` of every 128-byte line of ``row[0 : n]`` (int32), one line a thread."""
    tid = gl.arange(0, 128, layout=PER_THREAD)
    nbytes = n * 4
    for c in range(0, gl.cdiv(nbytes, 128 * 128)):
        off = (c * 128 + tid) * 128
        _prefetch_l2((row.to(gl.pointer_type(gl.int8)) + gl.where(off < nbytes, off, 0)).to(gl.int64, bitcast=True))


@gluon.jit
def _prefetch_l2(addr):
    """``prefetch.global.L2`` of the line of each address in ``addr`` (int64): no register written, nothing waits."""
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], gl.int32, False, 1)


# PF: the lines of 64 rows to prefetch into L2, [64 rows, 8 lines] with the rows of the pieces' layouts (L_W8R /
# L_W2, lanes along the rows: 2 lines a thread; plain fp8's L_W8: 1)
L_PF = gl.constexpr(gl.BlockedLayout([1, 2], [8, 4], [4, 1], [0, 1]))
L_PF8 = gl.constexpr(gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _prefetch_block_l2(base, BPT: gl.constexpr, lay: gl.constexpr):
    """PF: ``prefetch.global.L2`` of every 128-byte line of the rows ``base`` [64] (byte pointers; an invalid row
    points at row 0): line k of a row at byte min(128 k, BPT - 1), so that the 8 cover a row of up to 896 bytes
    at any alignment.  A prefetch writes no register: the producer does not wait for it, and its later loads of
    those rows find them in L2."""
    k = gl.arange(0, 8, layout=gl.SliceLayout(0, lay))
    off = gl.minimum(k * 128, BPT - 1)
    _prefetch_l2((gl.convert_layout(base, gl.SliceLayout(1, lay))[:, None] + off[None, :]).to(gl.int64, bitcast=True))


@gluon.jit
def _prefetch_next(nbase, nidx, kv_ptr, BPT: gl.constexpr, IDX2: gl.constexpr, PF: gl.constexpr, FP4: gl.constexpr,
                   DS: gl.constexpr):
    """PF, at the middle of block i (its piece 2 stored: the index load of the next rows has landed with that
    piece's loads, so reading it stalls nothing more): the next rows into L2 -- block i + 2's with IDX2 (``nidx``,
    a whole block ahead of their first loads), else block i + 1's (``nbase``)."""
    if PF:
        if FP4 or DS:
            lay: gl.constexpr = L_PF
        else:
            lay: gl.constexpr = L_PF8
        if IDX2:
            _prefetch_block_l2(_ptrs(nidx, kv_ptr, BPT)[0], BPT, lay)
        else:
            _prefetch_block_l2(nbase, BPT, lay)


@gluon.jit
def _bidx(idx_row, p0, k_end, k_stop, rows_l: gl.constexpr, EI: gl.constexpr):
    """``block_indices``; EARLY_IDX: the load bounded by the split's end ``k_stop`` alone, the positions at or past
    the valid count's ``k_end`` set to -1 after it, so that the load does not wait for the valid count's."""
    if EI:
        offs = p0 + gl.arange(0, 64, layout=rows_l)
        return gl.where(offs < k_end, block_indices(idx_row, p0, k_stop, rows_l), -1)
    else:
        return block_indices(idx_row, p0, k_end, rows_l)


@gluon.jit
def _producer(args, BPT: gl.constexpr, ROPE: gl.constexpr, SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr,
              DS: gl.constexpr, FP4: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr, B16: gl.constexpr,
              CL: gl.constexpr, HINT: gl.constexpr = False, W128: gl.constexpr = False, tr=None,
              TRACE: gl.constexpr = False, EARLY: gl.constexpr = False, LATE: gl.constexpr = False,
              IDX2: gl.constexpr = False, EI: gl.constexpr = False, PF: gl.constexpr = False,
              PS: gl.constexpr = False):
    """The producer partition: the program's item (PS: each of its items in turn, ``_produce_item``)."""
    if PS:
        K, vc_ptr, num_splits, n_items = args[11], args[9], args[13], args[14]
        step = gl.num_programs(0)
        gb = 0
        j = 0
        nv = valid_rows(gl.program_id(0), K, vc_ptr, num_splits, NG, HAS_VC)
        for item in range(gl.program_id(0), n_items, step):
            nv_next = _next_rows(item, step, n_items, K, vc_ptr, num_splits, NG, HAS_VC)
            gb = _produce_item(args, item, j, gb, BPT, ROPE, SCALE_OFF, ROPE_OFF, DS, FP4, NG, HAS_VC, B16, CL, HINT,
                               W128, tr, TRACE, EARLY, LATE, IDX2, EI, PF, PS, nv)
            nv = nv_next
            j += 1
    else:
        _produce_item(args, gl.program_id(0), 0, 0, BPT, ROPE, SCALE_OFF, ROPE_OFF, DS, FP4, NG, HAS_VC, B16, CL,
                      HINT, W128, tr, TRACE, EARLY, LATE, IDX2, EI, PF, PS)


@gluon.jit
def _next_rows(item, step, n_items, K, vc_ptr, num_splits, NG: gl.constexpr, HAS_VC: gl.constexpr):
    """PS: the valid rows of the program's item after ``item`` (the last item's own past the end), loaded while
    ``item`` is served, out of the next item's chain."""
    return valid_rows(gl.minimum(item + step, n_items - 1), K, vc_ptr, num_splits, NG, HAS_VC)


@gluon.jit
def _produce_item(args, item, j, gb, BPT: gl.constexpr, ROPE: gl.constexpr, SCALE_OFF: gl.constexpr,
                  ROPE_OFF: gl.constexpr, DS: gl.constexpr, FP4: gl.constexpr, NG: gl.constexpr,
                  HAS_VC: gl.constexpr, B16: gl.constexpr, CL: gl.constexpr, HINT: gl.constexpr, W128: gl.constexpr,
                  tr, TRACE: gl.constexpr, EARLY: gl.constexpr, LATE: gl.constexpr, IDX2: gl.constexpr,
                  EI: gl.constexpr, PF: gl.constexpr, PS: gl.constexpr, nv=None):
    """Item ``item`` (the ``j``-th of the program, after ``gb`` blocks; ``nv``: its valid rows, loaded ahead): stages q, then converts each 64-row block
    into tile (gb + i) % 2 (see the module docstring); returns gb + its block count.  Loads run two
    pieces ahead of the conversion: piece P + 2 (after the last value piece: the rope, then the next block's
    first two pieces) is loaded before piece P is converted; the next block's rows are looked up at the start
    of a block.  fp8_ds_mla's bf16 rope needs no conversion: it is copied into the tile by cp.async as soon as
    the tile is free, and waited for before the tile is published.  IDX2: the rows are looked up two blocks
    ahead, so that the next block's loads need no index load of their own (one memory latency fewer in the
    producer's chain a block).  EI: the split's indices prefetched into L2 before q is staged, and no index load
    waiting for the valid count's.  PF: once piece 2 is stored, the next block's rows (IDX2: the block after
    next) prefetched into L2, so that their loads, which each wait for every load in flight (one scoreboard),
    find them there."""
    (q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr, H, K,
     rows_per_split, num_splits, n_items, smem,
     bars) = args
    qL, qR, qE, kLw, kRw, kEw, sQ, sV = smem
    q_bar, ready, free, q_free = bars
    t, s, g, k_begin, k_end = item_coords(item, H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC, nv)
    tr = _trace_row(tr, item, TRACE)
    _stamp(tr, 2, 0, TRACE)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    k_stop = gl.minimum(k_begin + rows_per_split, K)  # the split's end, without the valid count's load
    if EI:
        _prefetch_rows_l2(idx_row + k_begin, k_stop - k_begin)
    # q [64 heads, 576] (rows of heads >= H zero-filled)
    LB: gl.constexpr = cga(L_B16, CL)
    heads = g * 64 + gl.arange(0, 64 * head_groups(CL), layout=gl.SliceLayout(1, LB))
    hm = heads < H
    q_row = gl.multiple_of(q_ptr + t.to(gl.int64) * stride_qt + gl.where(hm, heads, 0).to(gl.int64) * stride_qh, 16)
    qe_row = gl.multiple_of(qr_ptr + t.to(gl.int64) * stride_rt + gl.where(hm, heads, 0).to(gl.int64) * stride_rh, 16)
    # bf16 rows, persistent: the item's first block is copied before its q, whose buffer waits for warpgroup 0's
    # last QK of the previous item (_copy_blocks)
    QLATE: gl.constexpr = PS and B16
    if PS and not QLATE:  # warpgroup 0 is done with the previous item's q (a fresh mbarrier passes phase 1 at once)
        mbarrier.wait(q_free, (j & 1) ^ 1)
    if DS or B16:
        if not QLATE:
            _copy_q(q_row, qe_row, hm, qL, qR, qE, q_bar, ROPE, LB)
    else:
        _stage_q_f16(q_row, qe_row, hm, qL, qR, qE, sQ, ROPE, CL)
        fence_async_shared()  # q is read by the consumers' wgmma (async proxy)
        publish(q_bar)
    _stamp(tr, 3, 0, TRACE)

    n_blocks = gl.cdiv(k_end - k_begin, 64)
    if PS:  # an empty item still publishes one (all-invalid) block: its epilogue goes out through that tile
        n_blocks = gl.maximum(n_blocks, 1)
    if B16:
        _copy_blocks(idx_row, k_begin, k_end, n_blocks, kv_ptr, kLw, kRw, kEw, sV, ready, free, BPT, ROPE, ROPE_OFF,
                     W128, tr, TRACE, IDX2, k_stop, EI, gb, QLATE, (q_row, qe_row, hm, qL, qR, qE, q_bar, q_free, j))
    elif CL:
        _convert_blocks_cl(idx_row, k_begin, k_end, n_blocks, kv_ptr, kLw, kRw, kEw, sV, ready, free, BPT, ROPE,
                           SCALE_OFF, ROPE_OFF, DS, FP4)
    else:
        # the rows in the layout of the pieces (rl) and, for plain fp8, of its 64-byte rope (el; fp8_ds_mla's and
        # nvfp4's rope is read with the pieces' pointers)
        if FP4:
            rl: gl.constexpr = gl.SliceLayout(1, L_W2)
        elif DS:
            rl: gl.constexpr = gl.SliceLayout(1, L_W8R)
        else:
            rl: gl.constexpr = gl.SliceLayout(1, L_W8)
        el: gl.constexpr = gl.SliceLayout(1, L_W2C)
        SEP: gl.constexpr = ROPE and not DS and not FP4  # a rope in its own layout
        base, valid = _ptrs(_bidx(idx_row, k_begin, k_end, k_stop, rl, EI), kv_ptr, BPT)
        raw, sc = _load_piece(base, valid, 0, SCALE_OFF, DS, FP4, False, HINT)
        raw1, sc1 = _load_piece(base, valid, 1, SCALE_OFF, DS, FP4, False, HINT)
        nidx = 0
        if IDX2:
            nidx = _bidx(idx_row, k_begin + 64, k_end, k_stop, rl, EI)
        for i in range(n_blocks):
            b = (gb + i) % 2
            if IDX2:  # block i + 1's rows were looked up a block ago; block i + 2's now
                nbase, nvalid = _ptrs(nidx, kv_ptr, BPT)
                nidx = _bidx(idx_row, k_begin + (i + 2) * 64, k_end, k_stop, rl, EI)
            else:
                nbase, nvalid = _ptrs(_bidx(idx_row, k_begin + (i + 1) * 64, k_end, k_stop, rl, EI), kv_ptr, BPT)
            _stamp(tr, 16, i, TRACE, nbase)
            raw2, sc2 = _load_piece(base, valid, 2, SCALE_OFF, DS, FP4, False, HINT)
            if EARLY:  # every value piece in flight before the wait: none of their loads inside free -> ready
                raw3, sc3 = _load_piece(base, valid, 3, SCALE_OFF, DS, FP4, False, HINT)
            _stamp(tr, 17, i, TRACE)
            mbarrier.wait(free.index(b), (((gb + i) // 2) & 1) ^ 1)  # fresh mbarriers pass phase 1 at once
            _stamp(tr, 0, i, TRACE)
            if ROPE and DS:
                _copy_rope_bf16(kEw.index(b), base, valid, ROPE_OFF)  # kEw: the bf16 tile for fp8_ds_mla
            # which rows are valid (1.0 / 0.0), for warpgroup 0's mask: from shared memory, not a global load in
            # its serial chain of QK, softmax and PV
            sV.index(b).store(valid.to(gl.float32))
            _store_piece(raw, sc, _piece_dst(kLw, kRw, b, 0), DS, FP4)
            if not EARLY:
                raw3, sc3 = _load_piece(base, valid, 3, SCALE_OFF, DS, FP4, False, HINT)
            _store_piece(raw1, sc1, _piece_dst(kLw, kRw, b, 1), DS, FP4)
            if ROPE and not DS:
                if SEP and IDX2:  # this block's row pointers in the rope's layout: no second index load
                    rope = _load_rope(gl.convert_layout(base, el), gl.convert_layout(valid, el), ROPE_OFF, FP4,
                                      False, HINT)
                elif SEP:
                    rope = _load_rope(*_ptrs(_bidx(idx_row, k_begin + i * 64, k_end, k_stop, el, EI), kv_ptr, BPT),
                                      ROPE_OFF, FP4, False, HINT)
                else:
                    rope = _load_rope(base, valid, ROPE_OFF, FP4, False, HINT)
                _store_piece(raw2, sc2, _piece_dst(kLw, kRw, b, 2), DS, FP4)
                _prefetch_next(nbase, nidx, kv_ptr, BPT, IDX2, PF, FP4, DS)
                if not LATE:
                    raw, sc = _load_piece(nbase, nvalid, 0, SCALE_OFF, DS, FP4, False, HINT)
                _store_piece(raw3, sc3, _piece_dst(kLw, kRw, b, 3), DS, FP4)
                if not LATE:
                    raw1, sc1 = _load_piece(nbase, nvalid, 1, SCALE_OFF, DS, FP4, False, HINT)
                _store_rope(rope, kEw.index(b))
            else:
                if not LATE:
                    raw, sc = _load_piece(nbase, nvalid, 0, SCALE_OFF, DS, FP4, False, HINT)
                _store_piece(raw2, sc2, _piece_dst(kLw, kRw, b, 2), DS, FP4)
                _prefetch_next(nbase, nidx, kv_ptr, BPT, IDX2, PF, FP4, DS)
                if not LATE:
                    raw1, sc1 = _load_piece(nbase, nvalid, 1, SCALE_OFF, DS, FP4, False, HINT)
                _store_piece(raw3, sc3, _piece_dst(kLw, kRw, b, 3), DS, FP4)
            base = nbase
            valid = nvalid
            if ROPE and DS:
                async_copy.wait_group(0)  # this thread's rope copies have landed
            _stamp(tr, 14, i, TRACE)
            fence_async_shared()  # this thread's tile stores -> the consumers' wgmma (async proxy) reads
            _stamp(tr, 15, i, TRACE)
            compat.barrier()      # every producer thread has stored and fenced
            _stamp(tr, 1, i, TRACE)
            mbarrier.arrive(ready.index(b), count=1)
            if LATE:  # the next block's first pieces issued after the fence: none of them in flight across it
                raw, sc = _load_piece(nbase, nvalid, 0, SCALE_OFF, DS, FP4, False, HINT)
                raw1, sc1 = _load_piece(nbase, nvalid, 1, SCALE_OFF, DS, FP4, False, HINT)
    return gb + n_blocks


@gluon.jit
def _copy_q(q_row, qe_row, hm, qL, qR, qE, q_bar, ROPE: gl.constexpr, LB: gl.constexpr):
    """bf16 q as it is, by cp.async (heads off ``hm`` zero-filled); each thread arrives on q_bar once its copies
    have landed."""
    copy_rows(qL.index(0), q_row, 0, 256, hm, LB)
    copy_rows(qR.index(0), q_row, 256, 256, hm, LB)
    if ROPE:
        copy_rows(qE.index(0), qe_row, 0, 64, hm, LB)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)


@gluon.jit
def _copy_blocks(idx_row, k_begin, k_end, n_blocks, kv_ptr, kL, kR, kE, sV, ready, free, BPT: gl.constexpr,
                 ROPE: gl.constexpr, ROPE_OFF: gl.constexpr, W128: gl.constexpr = False, tr=None,
                 TRACE: gl.constexpr = False, IDX2: gl.constexpr = False, k_stop=0, EI: gl.constexpr = False, gb=0,
                 QLATE: gl.constexpr = False, qa=None):
    """bf16 rows: each 64-row block copied into tile (gb + i) % 2 by cp.async as it is (no conversion).  The producer
    does not wait for its copies: each thread's cp.async arrival on ready[b] fires when that thread's copies have
    landed, so the next block's copies are issued as soon as its tile is free and both tiles can be in flight.
    ready[b] counts those 128 arrivals and one more for sV[b] (the validity, stored by every thread, published
    after a warpgroup barrier by one thread's ordinary arrival).  The consumers fence for the async proxy after
    their wait.  W128: a warp's 16-byte copies cover 128 contiguous bytes of 4 rows (L_ROWS128, FlashInfer's
    gather), not 64 bytes of 8 rows.  QLATE: q (``qa``: its rows, row mask, buffers, q_bar and q_free, the item's
    index in the program) copied once the first block's copies are issued, after warpgroup 0 frees its buffer."""
    if W128:
        lay: gl.constexpr = L_ROWS128
    else:
        lay: gl.constexpr = L_B16
    rl: gl.constexpr = gl.SliceLayout(1, lay)
    base, valid = _ptrs(_bidx(idx_row, k_begin, k_end, k_stop, rl, EI), kv_ptr, BPT)
    if IDX2:
        nidx = _bidx(idx_row, k_begin + 64, k_end, k_stop, rl, EI)
    for i in range(n_blocks):
        b = (gb + i) % 2
        if IDX2:  # block i + 1's rows were looked up a block ago; block i + 2's now
            nbase, nvalid = _ptrs(nidx, kv_ptr, BPT)
            nidx = _bidx(idx_row, k_begin + (i + 2) * 64, k_end, k_stop, rl, EI)
        else:
            nbase, nvalid = _ptrs(_bidx(idx_row, k_begin + (i + 1) * 64, k_end, k_stop, rl, EI), kv_ptr, BPT)
        _stamp(tr, 16, i, TRACE, nbase)
        rows = base.to(gl.pointer_type(gl.bfloat16))
        _stamp(tr, 17, i, TRACE)
        mbarrier.wait(free.index(b), (((gb + i) // 2) & 1) ^ 1)  # fresh mbarriers pass phase 1 at once
        _stamp(tr, 0, i, TRACE)
        copy_rows(kL.index(b), rows, 0, 256, valid, lay)
        copy_rows(kR.index(b), rows, 256, 256, valid, lay)
        if ROPE:
            copy_rows(kE.index(b), rows, ROPE_OFF // 2, 64, valid, lay)
        async_copy.mbarrier_arrive(ready.index(b), increment_count=False)
        if QLATE:
            if i == 0:
                q_row, qe_row, hm, qL, qR, qE, q_bar, q_free, j = qa
                mbarrier.wait(q_free, (j & 1) ^ 1)  # (a fresh mbarrier passes phase 1 at once)
                _copy_q(q_row, qe_row, hm, qL, qR, qE, q_bar, ROPE, L_B16)
        _stamp(tr, 1, i, TRACE)
        sV.index(b).store(valid.to(gl.float32))
        base = nbase
        valid = nvalid
        compat.barrier()  # every producer thread stored its part of sV[b]
        mbarrier.arrive(ready.index(b), count=1)


@gluon.jit
def _trace_row(tr, item, TRACE: gl.constexpr):
    """TRACE: the trace buffer's row of work item ``item``, ``trace[item]`` as int64 words (``_stamp`` writes into
    it); ``tr`` itself otherwise."""
    if TRACE:
        tr = tr.to(gl.pointer_type(gl.int64), bitcast=True) + item.to(gl.int64) * (TRACE_EVENTS * TRACE_BLOCKS)
    return tr


@gluon.jit
def _stamp(tr, e: gl.constexpr, i, TRACE: gl.constexpr, after=None):
    """TRACE: thread 0 of the calling 4-warp partition writes %clock64 to trace[item, e, i] (``tr``: the item's
    row, ``_trace_row``).  ``after``: a tensor whose first element the clock read waits for (a value loaded or
    computed just before)."""
    if TRACE:
        off = e * TRACE_BLOCKS + i
        if after is None:
            tid = gl.arange(0, 128, layout=PER_THREAD)
            clk = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [tid], gl.int64, False, 1)
        else:  # the clock read takes the value as an operand, so it cannot be issued before the value is there
            v = after.to(gl.int64, bitcast=True)
            tid = gl.arange(0, v.shape[0], layout=v.type.layout)
            clk = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,l", [v], gl.int64, False, 1)
        gl.store(tr + off + tid * 0, clk, mask=(tid == 0) & (i < TRACE_BLOCKS))


@gluon.jit
def _qk(qL, qR, qE, kL, kR, kE, b, z, s_zero, ROPE: gl.constexpr):
    """S = q K^T for tile b (three chained wgmma, issued asynchronously)."""
    sc = warpgroup_mma(qL.index(z), kL.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sc = warpgroup_mma(qR.index(z), kR.index(b).permute((1, 0)), sc, is_async=True)
    if ROPE:
        sc = warpgroup_mma(qE.index(z), kE.index(b).permute((1, 0)), sc, is_async=True)
    return sc


@gluon.jit
def _stage(k, b):
    """Tile b of ``k`` (kL or kR, [2, 64, 256] of the tiles' 16-bit type) as bf16 [64, 256], the same bytes."""
    return compat.reinterpret(k, gl.bfloat16, [2, 64, 256],
                              gl.NVMMASharedLayout.get_default_for([64, 256], gl.bfloat16)).index(b)


@gluon.jit
def _out_store(acc, inv_l, col0: gl.constexpr, o_ptr, stride_ot, stride_os, stride_oh, t, s, g, H,
               CL: gl.constexpr = False, stage=None, SO: gl.constexpr = False):
    """Columns col0 .. col0 + 255 of heads 64 g .. 64 g + 63 (CL: 0 .. 127): acc [64, 256] x inv_l (per head).
    SO (a bf16 output): through ``stage`` [64, 256] bf16, a tile this warpgroup alone read and no longer needs, and
    out in 16-byte row stores, a warp writing 512 contiguous bytes of a head's row (stores from the accumulator
    layout cover 16 bytes of 8 rows a warp instruction, and the last block's epilogue waited on them)."""
    OL: gl.constexpr = cga(O_LAYOUT, CL)
    o = acc * inv_l[:, None]
    if SO:
        store_via_tile(o.to(gl.bfloat16), stage, o_ptr, t, s, g, stride_ot, stride_os, col0, H, stride_oh)
    else:
        heads = g * 64 + gl.arange(0, 64 * head_groups(CL), layout=gl.SliceLayout(1, OL))
        cols = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, OL))
        optr = (o_ptr + t.to(gl.int64) * stride_ot + s * stride_os + heads.to(gl.int64)[:, None] * stride_oh
                + cols[None, :])
        gl.store(optr, o.to(o_ptr.dtype.element_ty), mask=(heads < H)[:, None])


@gluon.jit
def _softmax_hand_off(sc, ss, sV, b, m_i, l_i, acc, sP, sA, p_free, p_ready, i, DS: gl.constexpr,
                      NAMED: gl.constexpr, CL: gl.constexpr = False):
    """Block i's online softmax on its scores sc (tile b's invalid rows masked), O rescaled; P and alpha handed to
    warpgroup 1 (through sP / sA once it is done with block i - 1's).  Returns (m, l, O)."""
    # tile b's valid rows (the producer's, behind ready[b])
    ok = sV.index(b).load(gl.SliceLayout(0, cga(S_LAYOUT, CL))) != 0.0
    if DS:
        sc = sc * ss
    else:
        sc = sc * ss[:, None]
    sc = gl.where(ok[None, :], sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, cga(O_LAYOUT, CL)))[:, None]
    if NAMED:
        named_barrier(P_FREE_SYNC)
    else:
        mbarrier.wait(p_free, (i & 1) ^ 1)
    sP.store(p.to(sP.dtype))
    sA.store(alpha)
    fence_async_shared()  # P is read by warpgroup 1's wgmma (async proxy)
    compat.barrier()  # (also for this warpgroup's own PV, which reads all of sP)
    if NAMED:
        named_barrier(P_READY_ARRIVE)
    else:
        mbarrier.arrive(p_ready, count=1)
    return m_new, l_i, acc


@gluon.jit
def _release(sig, free, b, CL: gl.constexpr):
    """Warpgroup 0 is done with tile b: a warpgroup barrier (every warp's reads of it are done), then its arrival on
    free[b] (CL: its signal to both CTAs' producers)."""
    compat.barrier()
    if CL:
        _signal(sig.index(2 * b), free.index(b))
    else:
        mbarrier.arrive(free.index(b), count=1)


@gluon.jit
def _wg0(args, ROPE: gl.constexpr, DS: gl.constexpr, FP4: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr,
         NAMED: gl.constexpr, CL: gl.constexpr, tr=None, TRACE: gl.constexpr = False, CF: gl.constexpr = True,
         FF: gl.constexpr = False, SO: gl.constexpr = False, PS: gl.constexpr = False):
    """Warpgroup 0: the program's item (PS: each of its items in turn, ``_wg0_item``)."""
    if PS:
        vc_ptr, K, num_splits, n_items = args[2], args[14], args[16], args[17]
        step = gl.num_programs(0)
        gb = 0
        j = 0
        nv = valid_rows(gl.program_id(0), K, vc_ptr, num_splits, NG, HAS_VC)
        for item in range(gl.program_id(0), n_items, step):
            nv_next = _next_rows(item, step, n_items, K, vc_ptr, num_splits, NG, HAS_VC)
            gb = _wg0_item(args, item, j, gb, ROPE, DS, FP4, NG, HAS_VC, NAMED, CL, tr, TRACE, CF, FF, SO, PS, nv)
            nv = nv_next
            j += 1
    else:
        _wg0_item(args, gl.program_id(0), 0, 0, ROPE, DS, FP4, NG, HAS_VC, NAMED, CL, tr, TRACE, CF, FF, SO, PS)


@gluon.jit
def _wg0_item(args, item, j, gb, ROPE: gl.constexpr, DS: gl.constexpr, FP4: gl.constexpr, NG: gl.constexpr,
              HAS_VC: gl.constexpr, NAMED: gl.constexpr, CL: gl.constexpr, tr, TRACE: gl.constexpr,
              CF: gl.constexpr, FF: gl.constexpr, SO: gl.constexpr, PS: gl.constexpr, nv=None):
    """Warpgroup 0 on item ``item`` (the ``j``-th of the program, after ``gb`` blocks; block i in tile (gb + i) %
    2): QK, softmax, P and alpha for warpgroup 1, PV for output columns 0-255, the lse.  Returns gb + its block
    count.  PS: the producer may stage the next item's q once this item's last QK is done (``q_free``), and the
    last block's tile is released only after the output went out through it."""
    (idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
     sm_scale_log2, k_scale, H, K, rows_per_split, num_splits, n_items, smem, bars) = args
    qL, qR, qE, kL, kR, kE, sP, sA, sL, sQ, sV, sig = smem
    q_bar, ready, free, p_ready, p_free, l_bar, q_free = bars
    t, s, g, k_begin, k_end = item_coords(item, H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC, nv)
    tr = _trace_row(tr, item, TRACE)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    if PS:  # (the producer publishes one all-invalid block for an empty item)
        n_blocks = gl.maximum(n_blocks, 1)
    SL: gl.constexpr = cga(S_LAYOUT, CL)
    OL: gl.constexpr = cga(O_LAYOUT, CL)
    HM: gl.constexpr = 64 * head_groups(CL)
    ss = sm_scale_log2
    if not DS and not FP4:
        ss = ss * k_scale  # plain fp8 rows hold value / k_scale
    s_zero = gl.zeros([HM, 64], gl.float32, SL)
    m_i = gl.full([HM], NEG_BIG, gl.float32, gl.SliceLayout(1, SL))
    l_i = gl.zeros([HM], gl.float32, gl.SliceLayout(1, SL))
    acc = gl.zeros([HM, 256], gl.float32, OL)
    _stamp(tr, 9, 0, TRACE)
    mbarrier.wait(q_bar, j & 1)
    if not DS:
        ss = ss * sQ.load(gl.SliceLayout(1, SL))  # fp16 q: each head's power-of-two scale undone on its scores
    if PS:  # == 0, opaque as z below: the item's first QK descriptors are not hoisted out of the item loop
        z0 = item // (n_items + 1)
    else:
        z0 = 0
    if n_blocks > 0:
        _stamp(tr, 6, 0, TRACE)
        mbarrier.wait(ready.index(gb % 2), (gb // 2) & 1)
        _stamp(tr, 7, 0, TRACE)
        fence_async_shared()
        sc = _qk(qL, qR, qE, kL, kR, kE, gb % 2 + z0, z0, s_zero, ROPE)
        sc = warpgroup_mma_wait(0, deps=(sc, ))
        _stamp(tr, 4, 0, TRACE)
    else:
        sc = s_zero
    # every block but the last: its softmax and P hand-off, its PV, the next block's QK behind it (the last block,
    # which has no next QK, is peeled off below: no branch on it inside the loop)
    for i in range(n_blocks - 1):
        b = (gb + i) % 2
        # z == 0, but the compiler cannot know it: shared-memory views indexed with it are recomputed in the
        # loop instead of their wgmma descriptors being hoisted out of it (and spilled)
        z = i // (n_blocks + 1)
        m_i, l_i, acc = _softmax_hand_off(sc, ss, sV, b + z, m_i, l_i, acc, sP, sA, p_free, p_ready, gb + i, DS,
                                          NAMED, CL)
        _stamp(tr, 5, i, TRACE)
        # P for this warpgroup's PV from shared memory as well: as a register operand its 16 registers would be
        # live beside O and the next S, past the 192 that ptxas needs to keep the wgmma pipeline unserialized
        # (measured: issuing that PV from registers before the hand-off, FlashMLA's order, was no faster)
        acc = warpgroup_mma(sP, kL.index(b + z), acc, is_async=True)
        nb = 1 - b
        if FF:
            # FREE_FIRST: tile b goes back to the producer as soon as this PV is done, before the wait for block
            # i + 1: the producer's refill of tile b (block i + 2) no longer waits for block i + 1 to be ready
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            _stamp(tr, 8, i, TRACE)
            _release(sig, free, b, CL)
            _stamp(tr, 6, i + 1, TRACE)
            mbarrier.wait(ready.index(nb), ((gb + i + 1) // 2) & 1)
            _stamp(tr, 7, i + 1, TRACE)
            if CF:
                fence_async_shared()
            sc = _qk(qL, qR, qE, kL, kR, kE, nb + z, z, s_zero, ROPE)
            sc = warpgroup_mma_wait(0, deps=(sc, ))
            _stamp(tr, 4, i + 1, TRACE)
        else:
            _stamp(tr, 6, i + 1, TRACE)
            mbarrier.wait(ready.index(nb), ((gb + i + 1) // 2) & 1)
            _stamp(tr, 7, i + 1, TRACE)
            if CF:  # LEAN: a converted tile was fenced by the producer before its arrival
                fence_async_shared()
            sc = _qk(qL, qR, qE, kL, kR, kE, nb + z, z, s_zero, ROPE)
            # tile b is released once this PV and the next QK's kL and kR parts are done (wgmma groups retire in
            # order, and each of the QK's wgmma is a group of its own).  Releasing it after the PV alone (waiting
            # with the QK's two or three groups outstanding) measured no faster (CHANGELOG).
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            _stamp(tr, 8, i, TRACE)
            _release(sig, free, b, CL)
            sc = warpgroup_mma_wait(0, deps=(sc, ))
            _stamp(tr, 4, i + 1, TRACE)
    if PS:  # every QK of this item is done: the producer may stage the next item's q
        compat.barrier()
        mbarrier.arrive(q_free, count=1)
    bL = (gb + n_blocks - 1) % 2  # the last block's tile
    if n_blocks > 0:
        i = n_blocks - 1
        m_i, l_i, acc = _softmax_hand_off(sc, ss, sV, bL, m_i, l_i, acc, sP, sA, p_free, p_ready, gb + i, DS,
                                          NAMED, CL)
        _stamp(tr, 5, i, TRACE)
        acc = warpgroup_mma(sP, kL.index(bL), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        _stamp(tr, 8, i, TRACE)
        if not PS:
            _release(sig, free, bL, CL)
    # both warpgroups normalize with these row sums
    sL.store(l_i)
    publish(l_bar)
    inv_l, lse = normalizer(m_i, l_i)
    if not DS and not FP4:
        inv_l = inv_l * k_scale
    if SO:
        if PS:
            stage = _stage(kL, bL)
        else:
            stage = _stage(kL, 0)
        _out_store(acc, gl.convert_layout(inv_l, gl.SliceLayout(1, OL)), 0, o_ptr, stride_ot, stride_os, stride_oh,
                   t, s, g, H, CL, stage, True)
    else:
        _out_store(acc, gl.convert_layout(inv_l, gl.SliceLayout(1, OL)), 0, o_ptr, stride_ot, stride_os, stride_oh,
                   t, s, g, H, CL)
    heads = g * 64 + gl.arange(0, HM, layout=gl.SliceLayout(1, SL))
    gl.store(lse_ptr + t.to(gl.int64) * stride_lt + s * stride_ls + heads * stride_lh, lse, mask=heads < H)
    if PS:  # the output went out through the last block's tile: it goes back to the producer now
        _release(sig, free, bL, CL)
    _stamp(tr, 10, 0, TRACE)
    return gb + n_blocks


@gluon.jit
def _wg1(args, DS: gl.constexpr, FP4: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr, NAMED: gl.constexpr,
         CL: gl.constexpr, tr=None, TRACE: gl.constexpr = False, CF: gl.constexpr = True, SO: gl.constexpr = False,
         PS: gl.constexpr = False):
    """Warpgroup 1: the program's item (PS: each of its items in turn, ``_wg1_item``)."""
    if PS:
        vc_ptr, K, num_splits, n_items = args[2], args[14], args[16], args[17]
        step = gl.num_programs(0)
        gb = 0
        j = 0
        nv = valid_rows(gl.program_id(0), K, vc_ptr, num_splits, NG, HAS_VC)
        for item in range(gl.program_id(0), n_items, step):
            nv_next = _next_rows(item, step, n_items, K, vc_ptr, num_splits, NG, HAS_VC)
            gb = _wg1_item(args, item, j, gb, DS, FP4, NG, HAS_VC, NAMED, CL, tr, TRACE, CF, SO, PS, nv)
            nv = nv_next
            j += 1
    else:
        _wg1_item(args, gl.program_id(0), 0, 0, DS, FP4, NG, HAS_VC, NAMED, CL, tr, TRACE, CF, SO, PS)


@gluon.jit
def _wg1_item(args, item, j, gb, DS: gl.constexpr, FP4: gl.constexpr, NG: gl.constexpr, HAS_VC: gl.constexpr,
              NAMED: gl.constexpr, CL: gl.constexpr, tr, TRACE: gl.constexpr, CF: gl.constexpr, SO: gl.constexpr,
              PS: gl.constexpr, nv=None):
    """Warpgroup 1 on item ``item`` (as ``_wg0_item``): PV for output columns 256-511 with warpgroup 0's P and
    alpha.  Returns gb + its block count."""
    (idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
     sm_scale_log2, k_scale, H, K, rows_per_split, num_splits, n_items, smem, bars) = args
    qL, qR, qE, kL, kR, kE, sP, sA, sL, sQ, sV, sig = smem
    q_bar, ready, free, p_ready, p_free, l_bar, q_free = bars
    t, s, g, k_begin, k_end = item_coords(item, H, K, vc_ptr, rows_per_split, num_splits, NG, HAS_VC, nv)
    tr = _trace_row(tr, item, TRACE)
    n_blocks = gl.cdiv(k_end - k_begin, 64)
    if PS:  # (the producer publishes one all-invalid block for an empty item)
        n_blocks = gl.maximum(n_blocks, 1)
    OL: gl.constexpr = cga(O_LAYOUT, CL)
    OR: gl.constexpr = gl.SliceLayout(1, OL)
    acc = gl.zeros([64 * head_groups(CL), 256], gl.float32, OL)
    if NAMED and not PS:
        if n_blocks > 0:
            named_barrier(P_FREE_ARRIVE)  # sP is free for block 0's P
    for i in range(n_blocks):
        b = (gb + i) % 2
        z = i // (n_blocks + 1)  # == 0; see _wg0
        if NAMED and PS:  # sP is free for this block's P (the previous block's PV, this program's, is done)
            named_barrier(P_FREE_ARRIVE)
        mbarrier.wait(ready.index(b), ((gb + i) // 2) & 1)
        _stamp(tr, 13, i, TRACE)
        if NAMED:
            named_barrier(P_READY_SYNC)
        else:
            mbarrier.wait(p_ready, (gb + i) & 1)
        _stamp(tr, 11, i, TRACE)
        if CF:  # LEAN: P was fenced by warpgroup 0, a converted tile by the producer, before their arrivals
            fence_async_shared()
        acc = acc * sA.load(OR)[:, None]
        acc = warpgroup_mma(sP, kR.index(b + z), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        _stamp(tr, 12, i, TRACE)
        if NAMED and not PS:
            if i + 1 < n_blocks:  # (warpgroup 0 syncs once a block: as many arrivals as syncs)
                named_barrier(P_FREE_ARRIVE)
        compat.barrier()  # every warp's MMA has read P, alpha and tile b
        if not NAMED:
            mbarrier.arrive(p_free, count=1)
        if CL:
            _signal(sig.index(2 * b + 1), free.index(b))
        elif PS:
            if i + 1 < n_blocks:  # the last block's tile: after the output went out through it
                mbarrier.arrive(free.index(b), count=1)
        else:
            mbarrier.arrive(free.index(b), count=1)
    mbarrier.wait(l_bar, j & 1)
    # the same normalizer as warpgroup 0 (m does not enter 1 / l)
    inv_l, lse_unused = normalizer(gl.zeros([64 * head_groups(CL)], gl.float32, OR), sL.load(OR))
    if not DS and not FP4:
        inv_l = inv_l * k_scale
    bL = (gb + n_blocks - 1) % 2
    if SO:
        if PS:
            stage = _stage(kR, bL)
        else:
            stage = _stage(kR, 0)
        _out_store(acc, inv_l, 256, o_ptr, stride_ot, stride_os, stride_oh, t, s, g, H, CL, stage, True)
    else:
        _out_store(acc, inv_l, 256, o_ptr, stride_ot, stride_os, stride_oh, t, s, g, H, CL)
    if PS:
        compat.barrier()  # every warp's output is out of the tile
        mbarrier.arrive(free.index(bL), count=1)
    return gb + n_blocks


@gluon.jit
def conv_kernel(q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr,
                o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls, stride_lh,
                sm_scale_log2, k_scale, H, K, rows_per_split, num_splits,
                fo_ptr, stride_ft, stride_fh, fl_ptr, stride_gt, stride_gh, n_items,
                BPT: gl.constexpr, ROPE: gl.constexpr, SCALE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr,
                NG: gl.constexpr, HAS_VC: gl.constexpr, DS: gl.constexpr, FP4: gl.constexpr,
                B16: gl.constexpr = False, NAMED: gl.constexpr = False, CL: gl.constexpr = False,
                FUSED: gl.constexpr = False, HINT: gl.constexpr = False,
                W128: gl.constexpr = False, TRACE: gl.constexpr = False, EARLY: gl.constexpr = False,
                LATE: gl.constexpr = False, LEAN: gl.constexpr = False, IDX2: gl.constexpr = False,
                FF: gl.constexpr = False, SO: gl.constexpr = False, EI: gl.constexpr = False,
                PF: gl.constexpr = False, PS: gl.constexpr = False):
    """One program = one work item, a query token x 64 heads (head group g of NG) x one split; launch with
    num_warps=4 (the default partition, warpgroup 0) and maxnreg=168 (see ``meta``).  ``n_items``: tokens x splits x
    NG.  PS (persistent): a grid of at most one program per SM, program p serving items p, p + grid, ... in turn,
    each partition running ahead into the next item as far as the shared buffers allow.  CL: one program = a
    cluster of two CTAs (launch with num_ctas=2) x 128 heads x one split, NG = 1."""
    # the 16-bit type of q, the tiles and P: fp16 where the values are exact in it (nvfp4, fp8), else bf16
    Q16: gl.constexpr = DS or B16  # bf16 q and tiles, q copied as it is, one softmax scale for every head
    if Q16:
        TD: gl.constexpr = gl.bfloat16
    else:
        TD: gl.constexpr = gl.float16
    if CL:
        # q, P and the per-head vectors split over the two CTAs (64 heads each); the tiles, the row validity
        # whole in each; every mbarrier one per CTA
        half: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 256], TD, cga_layout=[[1, 0]])
        small: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 64], TD, cga_layout=[[1, 0]])
        halfk: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 256], TD, cga_layout=[[0, 0]])
        smallk: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], TD, cga_layout=[[0, 0]])
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0], cga_layout=[[1]])
        vecv: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0], cga_layout=[[0]])
        bl: gl.constexpr = mbarrier.MBarrierLayout(cga_layout=[[1]])
        NC: gl.constexpr = 2
    else:
        half: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 256], TD)
        small: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], TD)
        halfk: gl.constexpr = half
        smallk: gl.constexpr = small
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        vecv: gl.constexpr = vec
        bl: gl.constexpr = mbarrier.MBarrierLayout()
        NC: gl.constexpr = 1
    qL = gl.allocate_shared_memory(TD, [1, 64 * NC, 256], half)
    qR = gl.allocate_shared_memory(TD, [1, 64 * NC, 256], half)
    qE = gl.allocate_shared_memory(TD, [1, 64 * NC, 64], small)
    kL = gl.allocate_shared_memory(TD, [2, 64, 256], halfk)
    kR = gl.allocate_shared_memory(TD, [2, 64, 256], halfk)
    kE = gl.allocate_shared_memory(TD, [2, 64, 64], smallk)
    sP = gl.allocate_shared_memory(TD, [64 * NC, 64], small)
    sA = gl.allocate_shared_memory(gl.float32, [64 * NC], vec)
    sL = gl.allocate_shared_memory(gl.float32, [64 * NC], vec)
    sQ = gl.allocate_shared_memory(gl.float32, [64 * NC], vec)  # fp16 q: 1 / each head's scale
    # tile b's valid rows (1.0 / 0.0), written by the producer with the tile
    sV = gl.allocate_shared_memory(gl.float32, [2, 64], vecv)
    q_bar = gl.allocate_shared_memory(gl.int64, [NC], bl)
    ready = gl.allocate_shared_memory(gl.int64, [2, NC], bl)
    free = gl.allocate_shared_memory(gl.int64, [2, NC], bl)
    p_ready = gl.allocate_shared_memory(gl.int64, [NC], bl)
    p_free = gl.allocate_shared_memory(gl.int64, [NC], bl)
    l_bar = gl.allocate_shared_memory(gl.int64, [NC], bl)
    if PS:
        q_free = gl.allocate_shared_memory(gl.int64, [NC], bl)  # warpgroup 0 is done with an item's q
    else:
        q_free = l_bar  # (unused)
    if CL:
        # the consumers' signals (``_signal``): [tile x warpgroup, destination CTA, source CTA, SIG_N]
        sig = gl.allocate_shared_memory(gl.int32, [4, 2, 2, SIG_N],
                                        gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0], cga_layout=[[1, 0, 0]]))
    else:
        sig = sV  # (unused)
    if Q16:
        mbarrier.init(q_bar, count=128)  # one cp.async arrival per producer thread
    else:
        mbarrier.init(q_bar, count=PUBLISH)  # the producer's publish() of fp16 q and its scales
    for b in gl.static_range(2):
        if B16:
            mbarrier.init(ready.index(b), count=129)  # each producer thread's cp.async arrival, and sV[b]'s
        else:
            mbarrier.init(ready.index(b), count=1)  # the producer, after a warpgroup barrier
        if CL:
            mbarrier.init(free.index(b), count=1)  # the producer's expect; the bytes of four warpgroups' signals
        else:
            mbarrier.init(free.index(b), count=2)   # both consumer warpgroups
    if not NAMED:
        # NAMED hands P over through named barriers and leaves these uninitialized: an initialized mbarrier that no
        # partition uses is dead to Triton's allocator, which put plain fp8's producer scratch over it (PTX wants an
        # mbarrier's memory invalidated before other use), and two row pointers read back as the mbarrier's state
        # (tests/test_sm90_compile.py checks every variant for an initialized mbarrier left unused)
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
    mbarrier.init(l_bar, count=PUBLISH)  # warpgroup 0's publish() of its row sums
    if PS:
        mbarrier.init(q_free, count=1)
    if CL:
        compat.fence_mbarrier_init_cluster()
        compat.cluster_barrier(relaxed=True)  # both CTAs' mbarriers initialized before either sends to the other
    # (constexprs reach a partition as constexprs only when written into warp_specialize's argument tuples)
    ca = (idx_ptr, stride_it, vc_ptr, o_ptr, stride_ot, stride_os, stride_oh, lse_ptr, stride_lt, stride_ls,
          stride_lh, sm_scale_log2, k_scale, H, K, rows_per_split, num_splits, n_items,
          (qL, qR, qE, kL, kR, kE, sP, sA, sL, sQ, sV, sig), (q_bar, ready, free, p_ready, p_free, l_bar, q_free))
    # the producer stores bf16 pairs as 32-bit words: the same bytes under the same 128-byte swizzle
    words: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    if B16:
        kLw = kL
        kRw = kR
    elif CL:
        # [tile, destination CTA, 64, 128]: the tiles as the producer's st.async addresses them
        words_cl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3,
                                                      cga_layout=[[1, 0, 0]])
        kLw = compat.reinterpret(kL, gl.int32, [2, 2, 64, 128], words_cl)
        kRw = compat.reinterpret(kR, gl.int32, [2, 2, 64, 128], words_cl)
    else:
        kLw = compat.reinterpret(kL, gl.int32, [2, 64, 128], words)
        kRw = compat.reinterpret(kR, gl.int32, [2, 64, 128], words)
    if Q16:
        kEw = kE  # fp8_ds_mla's bf16 rope is copied as it is (cp.async)
    elif CL:
        kEw = compat.reinterpret(kE, gl.int32, [2, 2, 64, 32], words_cl)
    else:
        kEw = compat.reinterpret(kE, gl.int32, [2, 64, 32], words)
    pa = (q_ptr, stride_qt, stride_qh, qr_ptr, stride_rt, stride_rh, kv_ptr, idx_ptr, stride_it, vc_ptr, H, K,
          rows_per_split, num_splits, n_items,
          (qL, qR, qE, kLw, kRw, kEw, sQ, sV), (q_bar, ready, free, q_free))
    if B16:
        PR: gl.constexpr = B16_PRODUCER_REGS
    elif PS:
        PR: gl.constexpr = PS_PRODUCER_REGS
    else:
        PR: gl.constexpr = PRODUCER_REGS
    # TRACE: the final-out pointer (read by FUSED variants only) carries the trace buffer (``_stamp``)
    # LEAN: the consumers fence for the async proxy after their in-loop waits only where the writer cannot (cp.async
    # tiles land after the producer's arrival; st.async tiles come from the partner CTA)
    CF: gl.constexpr = B16 or CL or not LEAN
    # SO: a bf16 output (one split) goes out through a tile (the partials of several splits are fp32)
    SOB: gl.constexpr = SO and o_ptr.dtype.element_ty == gl.bfloat16
    gl.warp_specialize([(_wg0, (ca, ROPE, Q16, FP4, NG, HAS_VC, NAMED, CL, fo_ptr, TRACE, CF, FF, SOB, PS)),
                        (_wg1, (ca, Q16, FP4, NG, HAS_VC, NAMED, CL, fo_ptr, TRACE, CF, SOB, PS)),
                        (_producer, (pa, BPT, ROPE, SCALE_OFF, ROPE_OFF, DS, FP4, NG, HAS_VC, B16, CL, HINT, W128,
                                     fo_ptr, TRACE, EARLY, LATE, IDX2, EI, PF, PS))],
                       [4, 4], [WG1_REGS, PR])
    if CL:
        # neither CTA exits while the other may still send to it (Triton 3.9 adds this barrier itself, 3.8 not)
        compat.cluster_barrier()
    if FUSED:  # the splits' partials merged by this grid's programs (common.combine_in_kernel)
        combine_in_kernel(o_ptr, lse_ptr, fo_ptr, stride_ft, stride_fh, fl_ptr, stride_gt, stride_gh, H, num_splits,
                          NG)


KINDS = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla", "bf16")  # the row formats this kernel reads


# How sparsemla.kernels.attention launches it (one cached launch per plan, compile-time arguments from
# meta()):
# ``grid``: ``(tokens x splits x num_groups,)`` (program p: head group p % num_groups, 64 heads, of split
# (p // num_groups) % splits of token p // (num_groups x splits)); ``args``: the positional arguments of the
# few-heads kernel (few.py; k_scale included); q rows and its RoPE part's rows 16-byte aligned (cp.async).
# 12 warps, 168 registers
# each at launch (warpgroup 0: 208 after setmaxnreg, warpgroup 1: 160, the producer: 136).

# The producer variants each row kind takes by default (one CTA; the 2-CTA kernel has its own producer), from an
# A/B of every variant in one process beside the peers (H100, b 128, 64 / 128 heads, graph replay, L2 flushed, us;
# CHANGELOG): bf16 rows gathered in 128-byte row segments (123 / 169 against 149 / 249); nvfp4 loads with the L2
# prefetch hint (114 / 207 against 119 / 226); fp8 rows with early + late_next + lean_fences + idx_ahead (103 / 192
# against 112 / 204; without idx_ahead 108 / 201); fp8_ds_mla with early + late_next + lean_fences (120 / 219
# against 122 / 222).  Slower: the hint on fp8 and fp8_ds_mla rows (146 / 258 for fp8_ds_mla), early + late on
# nvfp4 (129 / 245), idx_ahead with early + late on fp8_ds_mla at 128 heads (237), idx_ahead alone within 3 % of
# the default on every quantized kind.  The next block's rows prefetched into L2 (row_prefetch), H100, one process,
# 64 / 128 heads: fp8_ds_mla 108.6 / 199.0 against 115.1 / 207.9; nvfp4 106.7 / 199.3 against 104.8-117.5 / 195.0,
# plain fp8 (two blocks ahead with its idx_ahead) 103.3 / 190.0 against 99.9 / 181.3 (kept off); two blocks ahead on
# fp8_ds_mla 126.1 / 211.7.  The quantized kinds' named-barrier hand-off: NAMED in the module docstring.
TUNED = {"bf16": dict(rows128=True, free_first=True, smem_out=True, named=True),
         "nvfp4_ds_mla": dict(l2_hint=True, early_idx=True, smem_out=True, named=True),
         "fp8": dict(early=True, late_next=True, lean_fences=True, idx_ahead=True, smem_out=True, named=True),
         "fp8_ds_mla": dict(early=True, late_next=True, lean_fences=True, smem_out=True, row_prefetch=True,
                            named=True)}


# The options of a persistent plan (plan.PERSISTENT_KINDS, more work items than SMs)
PERSISTENT = dict(persist=True)


# nvfp4_ds_mla's producer with fp8_ds_mla's L2 handling (the next block's rows prefetched into L2, plain loads, the
# indices not prefetched): where it measured faster than TUNED's entry.  H100, decode b 128, one process, us at 64 /
# 128 heads, TUNED -> ROWS_PF: NoPE rows on Triton 3.6 112.4 / 203.1 -> 102.1 / 184.0; RoPE rows on 3.9 118.2 / 215.5
# -> 107.5 / 192.7, but on 3.6 105.4 / 192.1 -> 105.7 / 210.5 (docs/design/kernels.md).
ROWS_PF = dict(l2_hint=False, early_idx=False, row_prefetch=True)


def tuned(kind: str, rope_dim: int, release=None, num_groups: int = 1) -> dict:
    """The ``meta`` options a kind takes by default: its :data:`TUNED` entry, with :data:`ROWS_PF` for nvfp4_ds_mla's
    NoPE rows, and for its RoPE rows on Triton >= 3.9 (``release``: (major, minor); None: the installed one); on
    Triton >= 3.9 fp8_ds_mla above 64 heads (``num_groups`` > 1) without ``late_next``."""
    if release is None:
        release = triton_release()
    t = dict(TUNED.get(kind, {}))
    if kind == "nvfp4_ds_mla" and (not rope_dim or tuple(release) >= (3, 9)):
        t.update(ROWS_PF)
    # Triton 3.9 spills the late-next producer's pieces (stack 24 bytes against 8 without it); at 128 heads, where
    # every block is converted by two programs, that costs more than late_next saves.  H100, b 128, one process, us
    # with / without it: 211.8 / 201.6 at 128 heads, 111.2 / 115.3 at 64 (docs/design/kernels.md).
    if kind == "fp8_ds_mla" and num_groups > 1 and tuple(release) >= (3, 9):
        t["late_next"] = False
    return t


def meta(*, kind: str, bytes_per_row: int, rope_dim: int, rope_offset: int, scale_offset: int, num_groups: int,
         has_valid_counts: bool, named: bool | None = None, cluster: bool = False, fused: bool = False,
         l2_hint: bool | None = None, rows128: bool | None = None, early: bool | None = None,
         late_next: bool | None = None, lean_fences: bool | None = None, idx_ahead: bool | None = None,
         free_first: bool | None = None, smem_out: bool | None = None, early_idx: bool | None = None,
         row_prefetch: bool | None = None, persist: bool = False, trace: bool = False) -> dict:
    """``conv_kernel``'s constexprs and launch options for one variant (the arguments as in ``few.meta``;
    ``num_groups`` = ceil(heads / 64)).  ``cluster``: the 2-CTA kernel (module docstring; fp8, fp8_ds_mla and
    nvfp4_ds_mla rows, 65-128 heads, Triton >= 3.8), one program per token and split: ``num_groups`` must then be
    1.  ``fused`` as in ``few.meta`` (not with ``cluster``).

    Producer and consumer variants, ``None`` taking the kind's default (:func:`tuned`; off for the 2-CTA kernel):
    ``l2_hint`` (the producer's loads with FlashMLA's L2 prefetch hint), ``rows128`` (bf16 rows in 128-byte row
    segments), ``early`` (every value piece's loads before the producer's free wait), ``late_next`` (the next
    block's first pieces after its fence), ``lean_fences`` (the consumers' in-loop proxy fences left to the
    writers), ``idx_ahead`` (the producer looks the rows up two blocks ahead, not one), ``early_idx`` (the split's
    indices prefetched into L2 before q is staged, no index load waiting for the valid count's), ``free_first``
    (warpgroup 0 frees a tile when its PV on it is done, before it waits for the next block), ``smem_out`` (a bf16
    output through a tile, out in 16-byte row stores), ``row_prefetch`` (the quantized kinds: the producer prefetches
    the next block's rows into L2, two blocks ahead with ``idx_ahead``), ``named`` (P and alpha handed from
    warpgroup 0 to warpgroup 1 through named barriers, ``NAMED`` in the module docstring), ``persist`` (``PS``: at
    most one program per SM, each serving its items in turn; the launcher sizes the grid).  ``trace``: the diagnostic
    build that writes the SM clock at every hand-off into the buffer passed as ``fo_ptr``
    (``benchmarks/conv_trace.py`` launches it and reads the timeline).  (Variants that
    measured slower -- the next QK before the softmax or before this block's PV, P in registers for warpgroup 0's
    PV, a tile freed in halves, the validity as a score bias -- are described in docs/design/kernels.md and the
    CHANGELOG.)"""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    default = {} if cluster else tuned(kind, rope_dim, num_groups=num_groups)
    pick = lambda name, value: bool(default.get(name, False) if value is None else value)
    l2_hint, rows128, early = pick("l2_hint", l2_hint), pick("rows128", rows128), pick("early", early)
    late_next, lean_fences = pick("late_next", late_next), pick("lean_fences", lean_fences)
    idx_ahead, free_first = pick("idx_ahead", idx_ahead), pick("free_first", free_first)
    smem_out, early_idx = pick("smem_out", smem_out), pick("early_idx", early_idx)
    row_prefetch, named = pick("row_prefetch", row_prefetch), pick("named", named)
    if row_prefetch and (cluster or kind == "bf16"):
        raise ValueError(f"row_prefetch: an option of the one-CTA kernel's converting producer, got kind={kind!r}, "
                         f"cluster={cluster}")
    if cluster and (free_first or smem_out or early_idx):
        raise ValueError("free_first / smem_out / early_idx: options of the one-CTA kernel")
    if persist and (cluster or fused):
        raise ValueError("persist: a one-CTA kernel whose splits the combine kernel merges")
    if trace and (cluster or fused):
        raise ValueError("trace: its buffer is the final-out argument, which the 2-CTA and FUSED variants use")
    if cluster and idx_ahead:
        raise ValueError("idx_ahead: the 2-CTA kernel's producers have a loop of their own")
    if cluster and fused:
        raise ValueError("fused: the 2-CTA kernel merges its splits by the combine kernel")
    if cluster and (kind == "bf16" or num_groups != 1 or named):
        raise ValueError(f"cluster: the 2-CTA kernel reads quantized rows with num_groups=1 and the default "
                         f"hand-offs, got kind={kind!r}, num_groups={num_groups}, named={named}")
    ds, fp4 = kind == "fp8_ds_mla", kind == "nvfp4_ds_mla"
    m = dict(BPT=bytes_per_row, ROPE=rope_dim, SCALE_OFF=scale_offset if ds or fp4 else 0,
             ROPE_OFF=rope_offset if rope_dim else 0, NG=num_groups, HAS_VC=bool(has_valid_counts), DS=ds,
             FP4=fp4, B16=kind == "bf16", NAMED=named, CL=bool(cluster), num_warps=4, maxnreg=168,
             enable_fp_fusion=True, HINT=bool(l2_hint), W128=bool(rows128), TRACE=bool(trace), EARLY=bool(early),
             LATE=bool(late_next), LEAN=bool(lean_fences), IDX2=bool(idx_ahead), FF=bool(free_first),
             SO=bool(smem_out), EI=bool(early_idx), PF=bool(row_prefetch), PS=bool(persist), **fused_meta(fused))
    if cluster:
        m["num_ctas"] = 2
    return m
