"""Run every kernel of the library on small shapes, for compute-sanitizer (memcheck, racecheck, synccheck).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python3 tests/helpers/reliab_sanitize.py --tiny

``scripts/sanitize.sh`` runs it under each tool.  Sections (``--sections``, comma-separated; default all):

- ``attention``: every format x every ``triton*`` backend (and ``auto``) x the shapes that reach each kernel
  (few heads; head groups at 40 and 128 heads; 64-head programs with more than 132 programs of 16 heads;
  H = 1; widths that split the rows over programs, so the combine kernel runs) x decode, prefill over the
  cache and prefill over a bf16 workspace; valid counts with garbage rows past them that lie outside the
  cache (a read of one is an out-of-bounds access), -1 padding, an empty row, strided q / out / lse views.
- ``runner``: ``SparseMLA`` plan / run, decode and a prefill through its bf16 workspace.
- ``write``: cache writes of every format into the last rows of an exactly sized cache (bf16, fp32 and
  row-strided input; a skipped token; a token count no multiple of the tokens per program).
- ``attention_pair``: the attention kernels reading the query's RoPE part from a tensor of its own.
- ``indices``: ``convert_indices`` (plain, compact with valid counts, workspace starts).

- ``staging``: the top-k FP8 gather and the context upconvert of every format, into exactly sized outputs.
- ``indexer``: the index-key cache write, the index scores and the top-k (plain and pooled).

``--tiny`` keeps one width per shape (260 rows: split over programs, so the combine runs after every kernel)
and the fewest tokens (racecheck and synccheck are slow).  At the end
the driver prints the kernels that ran (and their compiled variants) and the ``*kernel`` functions of
``sparsemla.kernels`` that did not run.  Exit status 1 if a call raised.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import reliab_cases as rc  # noqa: E402

import sparsemla  # noqa: E402

DEV = "cuda"
FAILED = []
PLANNED = {}


def step(name, fn):
    t0 = time.time()
    try:
        fn()
        if torch.device(DEV).type == "cuda":
            torch.cuda.synchronize()
        print(f"ok   {name} ({time.time() - t0:.1f} s)", flush=True)
    except Exception as e:  # keep going: the sanitizer reports what the other kernels do
        FAILED.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


def _spec(fmt, backend, mode, heads, tokens, width, out="poisoned", lse="poisoned", q_layout="contiguous"):
    ctx = tuple(width + 3 for _ in range(tokens))
    return rc.Spec(fmt=fmt, backend=backend, mode=mode, heads=heads, tokens=tokens, width=width, block_size=64,
                   stride_extra=8, ctx=ctx, counts="mixed" if tokens >= 3 else "random", pad="holes", dup=False,
                   garbage="outside", kv="heavy", in_dtype="bfloat16",
                   k_scale=0.5 if sparsemla.get_format(fmt).uses_k_scale else 1.0, sm_scale=0.07, q_scale=1.0,
                   q_layout=q_layout, idx_layout="contiguous", out=out, lse=lse, seed=tokens * 131 + heads)


# (heads, tokens): few heads, H = 1, head groups, 64-head programs (34 x 4 > 132 programs of 16 heads), two head
# groups (bf16 rows: sm90-bf16; up to 64 heads they take sm90-conv)
SHAPES = [(16, 2), (1, 2), (40, 2), (64, 34), (128, 3)]
MORE_SHAPES = [(128, 40), (20, 5)]


def _attention_plan(tiny: bool, backends):
    """(backend, shapes, widths, modes) per backend: the default backend takes every shape; the others the
    shapes where their kernels differ.  ``triton`` is the default backend forced, so it runs only when
    there is no ``auto`` (the CPU)."""
    widths = (260,) if tiny else (64, 300)
    plan = []
    for b in backends:
        if b == "auto" or (b == "triton" and "auto" not in backends):
            shapes = SHAPES if tiny else SHAPES + MORE_SHAPES
            plan.append((b, shapes, widths, ("decode",)))
            plan.append((b, shapes[:1] if tiny else [(16, 2), (64, 34), (128, 3)], widths[-1:],
                         ("workspace",) if tiny else ("prefill", "workspace")))
        elif b == "triton":
            continue
        elif rc.is_staged(b):
            plan.append((b, [(16, 2)] if tiny else [(16, 2), (64, 34)], widths[-1:], ("decode",)))
        else:  # the portable kernels, the FP8-QK mode
            plan.append((b, [(16, 2), (64, 34)] if tiny else SHAPES, widths[-1:], ("decode",)))
    return plan


def attention(tiny: bool, fmts):
    for fmt in fmts:
        for backend, shapes, widths, modes in _attention_plan(tiny, rc.attention_backends(torch.device(DEV).type)):
            if fmt not in rc.backend_formats(backend, [fmt]):
                continue
            for heads, tokens in shapes:
                for width in widths:
                    for mode in modes:
                        spec = _spec(fmt, backend, mode, heads, tokens, width,
                                     q_layout="padded" if heads == 40 else "contiguous",
                                     lse="transposed" if heads == 16 else "poisoned")

                        k = str(rc.planned_kernel(spec, torch.cuda.get_device_capability() if DEV == "cuda" else (9, 0)))
                        PLANNED[k] = PLANNED.get(k, 0) + 1

                        def call(spec=spec):
                            try:
                                rc.run_case(rc.build_case(spec, DEV))
                            except rc.Refused as why:
                                print(f"     refused: {why}", flush=True)
                        step(f"attention {fmt} {backend} {mode} H={heads} T={tokens} K={width}", call)


def attention_pair(tiny: bool, fmts):
    """The query in two tensors (an engine's ``(q_nope, q_pe)`` pair, read in place): q_pe the last 64 dims of a
    projection ``[T, H, 192]`` whose allocation ends with the last head's rope values (a read past them is out of
    bounds), q_nope head-major; each kernel family (20, 64 and 128 heads)."""
    from sparsemla.kernels.attention import attention_fwd
    for fmt in fmts:
        if not sparsemla.get_format(fmt).rope_dim:
            continue
        for heads in (20, 64, 128):
            def call(fmt=fmt, heads=heads):
                c = rc.build_case(_spec(fmt, "auto", "decode", heads, 3, 260), DEV)
                q = c["q"]
                proj = torch.randn(3, heads, 192, device=DEV).to(torch.bfloat16)
                proj[..., 128:] = q[..., 512:]
                q_nope = torch.empty(heads, 3, 512, dtype=torch.bfloat16, device=DEV).transpose(0, 1)
                q_nope.copy_(q[..., :512])
                attention_fwd(q_nope, c["cache"].rows, c["fmt"], c["indices"], 0.07, valid_counts=c["valid_counts"],
                              k_scale=c["spec"].k_scale, q_pe=proj[..., 128:])
            step(f"attention pair {fmt} H={heads}", call)


def runner(tiny: bool, fmts):
    for fmt in fmts[:2] if tiny else fmts:
        def call(fmt=fmt):
            f = sparsemla.get_format(fmt)
            cache = sparsemla.PagedKVCache(f, 40, 64, DEV)
            rc.write_tokens(cache, torch.randn(cache.num_slots, 512, device=DEV),
                            torch.randn(cache.num_slots, f.rope_dim, device=DEV) if f.rope_dim else None,
                            torch.arange(cache.num_slots, dtype=torch.int32, device=DEV), 1.0)
            r = sparsemla.SparseMLA(max_tokens=16, max_requests=4, max_blocks_per_request=8, num_heads=16,
                                    head_dim=f.head_dim, topk=128, fmt=f, block_size=64, device=DEV, sm_scale=0.07,
                                    prefill_workspace_tokens=1024)
            md = sparsemla.BatchMetadata.from_lists([1, 1, 7], [100, 300, 200], [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9, 10]],
                                                    block_size=64, device=DEV)
            r.plan(md)
            q = torch.randn(9, 16, f.head_dim, device=DEV).to(torch.bfloat16)
            topk = torch.randint(0, 100, (9, 128), dtype=torch.int32, device=DEV)
            r.run(q, cache, topk)
        step(f"runner {fmt}", call)


def write(tiny: bool, fmts):
    for fmt in fmts:
        def call(fmt=fmt):
            f = sparsemla.get_format(fmt)
            small = sparsemla.PagedKVCache(f, 2, 64, DEV)
            slots = torch.tensor([127 - i for i in range(20)] + [-1], dtype=torch.int32, device=DEV)
            for dt in (torch.bfloat16, torch.float32):
                kv = torch.randn(21, 512, device=DEV).to(dt)
                pe = torch.randn(21, f.rope_dim, device=DEV).to(dt) if f.rope_dim else None
                small.write(kv, pe, slots)
                big = torch.randn(21, 576, device=DEV).to(dt)
                small.write(big[:, :512], big[:, 512:512 + f.rope_dim] if f.rope_dim else None, slots)
        step(f"write {fmt}", call)


def indices(tiny: bool, fmts):
    def call():
        bt = torch.tensor([[3, 0, 1, -1], [2, -1, -1, -1], [1, 2, 3, 0]], dtype=torch.int32, device=DEV)
        topk = torch.randint(-1, 256, (3, 128), dtype=torch.int32, device=DEV)
        req = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
        sparsemla.convert_indices(topk, req, bt, 64, 72)
        sparsemla.convert_indices(topk, req, bt, 64, 72, True, compact=True)
        ws = torch.tensor([-1, 0, 256], dtype=torch.int32, device=DEV)
        sparsemla.convert_indices(topk, req, bt, 64, 72, workspace_start=ws)
    step("convert_indices", call)



def staging(tiny: bool, fmts):
    from sparsemla.kernels.staging import gather_topk_fp8, upconvert_context
    for fmt in fmts:
        def call(fmt=fmt):
            c = rc.build_case(_spec(fmt, "auto", "decode", 4, 3, 64), DEV)
            cache = c["cache"]
            gather_topk_fp8(cache.rows, c["fmt"], c["indices"], c["valid_counts"], 1.0)
            nb = cache.num_blocks
            bt = torch.tensor([[nb - 1, 0], [1, -1], [nb - 2, nb - 1]], dtype=torch.int32, device=DEV)
            seq = torch.tensor([128, 1, 100], dtype=torch.int32, device=DEV)
            upconvert_context(cache.rows, c["fmt"], bt, seq, cache.block_size, cache.block_stride_rows)
        step(f"staging {fmt}", call)


def indexer(tiny: bool, fmts):
    from sparsemla.kernels.indexer import (INDEX_BYTES_PER_TOKEN, index_cache_write, index_scores, index_topk,
                                           quantize_index_q)

    def call():
        cache = torch.zeros(4, 64, INDEX_BYTES_PER_TOKEN, dtype=torch.uint8, device=DEV)
        k = torch.randn(255, 128, device=DEV).to(torch.bfloat16)
        slots = torch.arange(255, dtype=torch.int32, device=DEV)
        slots[7] = -1
        index_cache_write(cache, k, slots)
        q8, qs = quantize_index_q(torch.randn(5, 64, 128, device=DEV))
        w = torch.randn(5, 64, device=DEV) * qs
        bt = torch.tensor([[3, 2, 1, 0], [0, 1, -1, -1]], dtype=torch.int32, device=DEV)
        req = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32, device=DEV)
        ctx = torch.tensor([250, 251, 256, 70, 128], dtype=torch.int32, device=DEV)
        scores = index_scores(q8, w.float().contiguous(), cache, bt, req, ctx, 256)
        index_topk(scores, 64)
        index_topk(scores, 64, context_lens=ctx, kpool=4)
    step("indexer", call)


SECTIONS = {"attention": attention, "attention_pair": attention_pair, "runner": runner, "write": write, "indices": indices, "staging": staging,
            "indexer": indexer}


def kernel_functions():
    """Every ``*kernel`` JITFunction defined in ``sparsemla.kernels`` (importing its modules)."""
    from triton.runtime.jit import JITFunction
    import sparsemla.kernels as pkg
    names = []
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        try:
            mod = importlib.import_module(m.name)
        except Exception as e:  # pragma: no cover - reported, not fatal
            print(f"note: {m.name} does not import: {e}")
            continue
        for attr, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and attr.endswith("kernel") and getattr(fn, "module", m.name) == m.name:
                names.append(f"{m.name.rsplit('.', 1)[-1]}.{attr}")
    return sorted(set(names))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="fewest shapes (racecheck, synccheck)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    p.add_argument("--formats", default="all", help="format ids, comma-separated (default every format)")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu runs the driver's logic under the interpreter")
    args = p.parse_args(argv)
    global DEV
    DEV = args.device
    fmts = rc.format_ids() if args.formats == "all" else args.formats.split(",")
    t0 = time.time()
    for name in args.sections.split(","):
        SECTIONS[name](args.tiny, fmts)
    ran = rc.compiled_kernels()
    print(f"kernels run ({len(ran)}):", ", ".join(f"{k} x{v}" for k, v in sorted(ran.items())))
    missing = [k for k in kernel_functions() if k not in ran]
    print(f"kernels not run ({len(missing)}):", ", ".join(missing) or "none")
    print("attention kernels planned:", ", ".join(f"{k} x{v}" for k, v in sorted(PLANNED.items())))
    never = [k for k in rc.plan_kernel_names() if not any(p.startswith(k) for p in PLANNED)]
    print(f"attention kernels never planned ({len(never)}):", ", ".join(never) or "none")
    print(f"driver: {len(FAILED)} failed calls, {time.time() - t0:.0f} s", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
