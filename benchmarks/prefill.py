"""Sparse prefill through the runner, per format, with native reads and through the bf16 workspace; FlashMLA's
sparse prefill on bf16 rows in the same process.

    python3 benchmarks/prefill.py --results benchmarks/results/h200.jsonl        # P-32k, P-h64, P-h16
    python3 benchmarks/prefill.py --dry-run --formats fp8_ds_mla --results /tmp/r.jsonl

Geometry (``docs/benchmarking.md``, P-32k): one request with a 32,768-token context, its last 4,096 tokens
as queries, top-k 2048 distinct causal positions per token, 64-token blocks shuffled.  Timed: one
``SparseMLA.run`` (index conversion, the upconvert of the context when the runner has a bf16 workspace,
attention), CUDA-graph replay, L2 flushed, median of ``--reps``; the calls of a configuration (every format's,
FlashMLA's) are timed interleaved, a round of each in turn (``timing.time_fns``).  TFLOP/s = 2 h (valid pairs)
(576 + 512) / time.  ``native reads``: the attention kernel reads the quantized rows; ``bf16 workspace``:
``SparseMLA(..., prefill_workspace_tokens=32768)``.  FlashMLA: ``flash_mla_sparse_fwd(..., use_legacy=True)``
on the bf16 cache's rows, q padded to 64 / 128 heads.  ``--kernel sm90-conv`` (repeatable) also times the attention
launcher alone on a plan forced to that kernel (native reads; impl ``sparsemla-conv``), beside the rest in one
process: an A/B of the kernels a prefill could take (write such rows to a file of your own).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before anything imports a kernel: Triton picks the interpreter at decoration
    os.environ["TRITON_INTERPRET"] = "1"
from sparsemla.bench.drivers import prepare_environment  # noqa: E402

prepare_environment()

import torch  # noqa: E402

from sparsemla.bench import drivers as D  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402  (its forced_call, a plan forced to one kernel, and its rows)

REL_TOL = 2e-2


def runner_call(wl, workspace: bool):
    from sparsemla import BatchMetadata, SparseMLA
    cfg, lay = wl.config, wl.layout
    nblk = lay.block_table.shape[1]
    ctx = int(lay.context_lens[0])
    md = BatchMetadata.from_lists([cfg.s_q], [ctx], [lay.block_table[0].tolist()], block_size=lay.block_size,
                                  device=wl.q.device)
    attn = SparseMLA(cfg.s_q, 1, nblk, cfg.num_heads, wl.fmt.head_dim, cfg.topk, wl.fmt, block_size=lay.block_size,
                     sm_scale=wl.sm_scale, device=wl.q.device, prefill_workspace_tokens=ctx if workspace else 0)
    attn.plan(md)
    out = torch.empty(cfg.s_q, cfg.num_heads, 512, dtype=torch.bfloat16, device=wl.q.device)
    lse = torch.empty(cfg.s_q, cfg.num_heads, dtype=torch.float32, device=wl.q.device)
    return (lambda: attn.run(wl.q, wl.cache, wl.topk_local, wl.k_scale, out=out, lse=lse)), out


def rel_err(wl, out) -> float:
    from sparsemla.reference import sparse_mla
    sel = torch.linspace(0, wl.q.shape[0] - 1, 4, device=wl.q.device).long()
    ref, _ = sparse_mla(wl.q[sel], wl.cache, wl.indices[sel], wl.sm_scale, valid_counts=wl.valid_counts[sel],
                        k_scale=wl.k_scale)
    return ((out[sel].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def prepared(entries, wl, impl, call, out, variant):
    """Append (impl, wl, call, variant, error) to ``entries`` once ``call``'s output (``out``; None: a peer's, not
    checked) is within REL_TOL of float64."""
    err = None
    if out is not None:
        call()
        err = rel_err(wl, out)
        if not err < REL_TOL:
            raise AssertionError(f"output off by {err:.2e} relative to float64: not timed")
    entries.append((impl, wl, call, variant, err))


def record(rec, name, wl, impl, us, timing, variant, err):
    row = decode.record(rec, "prefill", name, wl, impl, us, timing, variant, err)
    D.print_row(row, f"  {row['tflops']:.0f} TFLOP/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    D.common_args(ap, formats="bf16,fp8,fp8_ds_mla,nvfp4_ds_mla", reps=10)
    ap.add_argument("--heads", default="128,64,16", help="comma list: 128 = P-32k, 16 = P-h16, others P-h<H>")
    ap.add_argument("--kernel", action="append", default=[], metavar="KERNEL[:K=V[,K=V]]",
                    help="also time the attention launcher forced to this plan kernel (e.g. sm90-conv; sm_90), native "
                    "reads, as impl sparsemla-<name>, built with the options after a colon (sm90-bf16: bf16.meta's, "
                    "e.g. sm90-bf16:rows128=1); repeatable.  For A/B runs: write the rows to a file of your own")
    ap.add_argument("--conv-variant", action="append", default=[], metavar="K=V[,K=V]",
                    help="also time the attention launcher forced to sm90-conv built with these conv.meta options, as "
                    "impl sparsemla-conv with the options as its variant; repeatable.  For A/B runs, like --kernel")
    a = ap.parse_args(argv)
    from sparsemla.bench import peers as P
    from sparsemla.bench.workload import build_queries, build_workload
    from sparsemla.formats import get_format
    rec = D.Recorder(a)
    # the forced launches beside the runner: (impl, kernel, conv.meta options, variant text)
    forced = []
    for spec in a.kernel:
        k, _, opts = spec.partition(":")
        v = decode.parse_options(opts) or None
        text = f"native reads, {k} forced" + (f", {decode.variant_label(v)}" if v else "")
        forced.append(("sparsemla-" + k.split("-", 1)[-1], k, v, text))
    forced += [("sparsemla-conv", "sm90-conv", v, f"native reads, sm90-conv forced, {decode.variant_label(v)}")
               for v in map(decode.parse_options, a.conv_variant)]
    base_cfg = D.config_named("P-32k")
    bases = {}  # each format's cache and context, built once
    for h in D.int_list(a.heads):
        name = {128: "P-32k", 16: "P-h16"}.get(h, f"P-h{h}")
        cfg = D.scaled(replace(base_cfg, id=name, name=name, num_heads=h), rec.dry)
        # every format's calls (and FlashMLA's) of this configuration are checked first, then timed interleaved
        # (timing.time_fns): timed one after the other, the later ones ran 3-7 % faster than an interleaved run
        # gives them, which went into their ratios to FlashMLA's bf16 figure
        entries = []
        for fname in D.fmt_list(a.formats):
            fmt = get_format(fname)
            if fname not in bases:
                bases[fname] = build_workload(cfg, fmt, device=rec.device)
            wl = build_queries(cfg, bases[fname].cache, bases[fname].layout)
            modes = [("native reads", False)] + ([("bf16 workspace", True)] if fmt.name != "bf16" else [])
            for variant, ws in modes:
                rec.attempt(f"{name} {fname} {variant}",
                            lambda: prepared(entries, wl, "sparsemla", *runner_call(wl, ws), variant))
            for impl, k, v, text in ([] if rec.dry else forced):  # Gluon kernels: not under the interpreter
                rec.attempt(f"{name} {fname} {text}",
                            lambda: prepared(entries, wl, impl, *decode.forced_call(wl, k, variant=v), text))
            if fmt.name == "bf16" and fmt.rope_dim and not a.no_peers:
                rec.attempt(f"{name} {fname} flashmla",
                            lambda: prepared(entries, wl, "flashmla",
                                             P.flashmla_prefill(wl, wl.cache.rows.view(torch.bfloat16)), None,
                                             "bf16 rows, use_legacy=True"))
        if entries:
            timed = rec.time_many([e[2] for e in entries])
            for (impl, wl, call, variant, err), (us, timing) in zip(entries, timed):
                record(rec, name, wl, impl, us, timing, variant, err)
        del entries
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
