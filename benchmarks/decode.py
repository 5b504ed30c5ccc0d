"""Decode kernel time of sparsemla and the peers in one process: every format x head count, b 128.

    python3 benchmarks/decode.py --heads 16,64,128 --results benchmarks/results/h200.jsonl
    python3 benchmarks/decode.py --formats fp8_ds_mla --heads 128 --reps 50          # print only
    python3 benchmarks/decode.py --dry-run --results /tmp/r.jsonl                      # CPU check
    python3 benchmarks/decode.py --conv --heads 64,128 --formats bf16,fp8_ds_mla               # + sm90-conv forced
    python3 benchmarks/decode.py --cluster --heads 128 --formats fp8_ds_mla                    # + sm90-cluster forced
    python3 benchmarks/decode.py --heads 64,128 --formats fp8_ds_mla --conv --conv-variant idx_ahead=1 \
        --conv-variant named=1 --results lab/ab.jsonl                      # + sm90-conv variants, A/B in one process
    python3 benchmarks/small_batch.py --fused                                                  # + splits merged in-kernel

Per format, one cache of b requests x 32,768 tokens (shuffled 64-token blocks, heavy-tailed values written
through the library's cache write), then per head count the same queries and indices for everyone:

* ``sparsemla``: ``sparse_mla_decode`` with its default backend; ``sparsemla-fp8qk``: backend
  ``triton-fp8qk`` (the FP8-QK mode; fp8 and fp8_ds_mla rows, sm_90); with ``--conv``, ``sparsemla-conv``:
  the launcher on a plan forced to ``sm90-conv`` (sm_90), beside the plan's choice where that is another kernel
  (bf16 rows above 64 heads, small batches); with ``--conv-variant K=V[,K=V]``, the same kernel built with those
  ``conv.meta`` options (``KernelPlan.variant``; the row's variant names them); with ``--cluster``,
  ``sparsemla-cluster``: forced to ``sm90-cluster`` (its rows and heads, Triton >= 3.8); with ``--fused``,
  ``sparsemla-fused``: the plan's kernel merging its splits itself (``fused_combine``) where a call splits (small
  batches);
* the peer that reads the same bytes: FlashMLA for fp8_ds_mla (q padded to 64 / 128 heads), FlashInfer for
  bf16 and fp8 (page size 1), prepared once outside the timed call (``sparsemla.bench.peers``).

Every call is timed by CUDA-graph replay (kernel time, no launch gaps), the L2 flushed before each replay,
median of ``--reps``; the calls of one (format, configuration) -- ours, the forced kernels, the peer -- are timed
interleaved, a round of each in turn (``timing.time_fns``), so that drift during the process stays out of their
ratios; SOL by ``docs/benchmarking.md``'s accounting with ceilings measured in this process.
Our output is checked against the float64 reference on a few tokens before it is timed.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before anything imports a kernel: Triton picks the interpreter at decoration
    os.environ["TRITON_INTERPRET"] = "1"
from sparsemla.bench.drivers import prepare_environment  # noqa: E402

prepare_environment()

import torch  # noqa: E402

from sparsemla.bench import drivers as D  # noqa: E402
from sparsemla.bench.accounting import achieved, attention_work  # noqa: E402
from sparsemla.plan import CLUSTER_HEADS, CLUSTER_KINDS, CONV_KINDS  # noqa: E402  (rows and heads they read)

FP8QK_BACKEND = "triton-fp8qk"
FP8QK_FORMATS = ("fp8", "fp8_ds_mla", "fp8-nope", "fp8_ds_mla-nope")
CONV_KERNEL = "sm90-conv"
CLUSTER_KERNEL = "sm90-cluster"
ALL_FORMATS = "bf16,fp8,fp8_ds_mla,nvfp4_ds_mla,bf16-nope,fp8-nope,fp8_ds_mla-nope,nvfp4_ds_mla-nope"
CHECK_TOKENS = 4
REL_TOL = 2e-2  # a wrong kernel is far off; the formats' own error is ~1e-3 against float64 on their rows


def ours_call(wl, backend="auto"):
    import sparsemla
    t, h, _ = wl.q.shape
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device=wl.q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=wl.q.device)

    def call():
        return sparsemla.sparse_mla_decode(wl.q, wl.cache, wl.indices, wl.sm_scale, wl.valid_counts, wl.k_scale,
                                           backend=backend, out=out, lse=lse)
    return call, out


def forced_call(wl, kernel=None, fused_combine=None, variant=None):
    """The attention launcher on a plan forced to ``kernel`` (an opt-in kernel the public API does not pick) or to
    merge its splits in the kernel (``fused_combine``), and built as ``variant`` (a dict of options of that kernel's
    build, ``KernelPlan.variant``), the same rows, indices and outputs as ``ours_call``; the split partials in a
    buffer of their own, as a runner's (a call captured in a CUDA graph otherwise allocates them, and merges them by
    the combine kernel)."""
    from dataclasses import replace

    from sparsemla.kernels.attention import attention_fwd, plan_for, split_elements
    t, h, _ = wl.q.shape
    rows = wl.cache.rows
    plan = plan_for(wl.q, rows, wl.fmt, wl.indices.shape[1], kernel=kernel, fused_combine=fused_combine)
    if variant:
        plan = replace(plan, variant=tuple(sorted(variant.items())))
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device=wl.q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=wl.q.device)
    n = split_elements(plan, t, h)
    split = torch.empty(n, dtype=torch.float32, device=wl.q.device) if n else None

    def call():
        return attention_fwd(wl.q, rows, wl.fmt, wl.indices, wl.sm_scale, plan=plan, valid_counts=wl.valid_counts,
                             k_scale=wl.k_scale, out=out, lse=lse, split_buffers=split)
    return call, out


def parse_options(text: str) -> dict:
    """``"idx_ahead=1,named=0"`` -> ``{"idx_ahead": True, "named": False}`` (1 / 0 / true / false as booleans,
    integers as ints, anything else as text)."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        if "=" not in item:
            raise SystemExit(f"--conv-variant: expected key=value, got {item!r}")
        k, v = (x.strip() for x in item.split("=", 1))
        low = v.lower()
        out[k] = {"1": True, "true": True, "0": False, "false": False}.get(low, int(v) if v.isdigit() else v)
    return out


def variant_label(options: dict) -> str:
    """``{"idx_ahead": True}`` -> ``"idx_ahead=True"``: a variant's options as its rows' ``variant``."""
    return ",".join(f"{k}={v}" for k, v in sorted(options.items()))


def fused_applies(wl) -> bool:
    """Whether the plan of this workload can merge its splits in the kernel (``fused_combine``)."""
    from sparsemla.kernels.attention import plan_for
    return plan_for(wl.q, wl.cache.rows, wl.fmt, wl.indices.shape[1], fused_combine=True).fused_combine


def check_against_reference(wl, call, out) -> float:
    """Relative error of the first tokens' output against float64 over the cache's own rows."""
    from sparsemla.reference import sparse_mla
    call()
    n = min(CHECK_TOKENS, wl.q.shape[0])
    ref, _ = sparse_mla(wl.q[:n], wl.cache, wl.indices[:n], wl.sm_scale, valid_counts=wl.valid_counts[:n],
                        k_scale=wl.k_scale)
    err = ((out[:n].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    if not err < REL_TOL:
        raise AssertionError(f"output off by {err:.2e} relative to float64 (limit {REL_TOL}): not timed")
    return err


def prepare(entries, cfg_name: str, wl, impl: str, make, *, variant=None, check=True):
    """Build one implementation's call on one workload (``make() -> (call, out)``), check its output against
    float64 (``check``), and append it to ``entries`` for ``time_and_record``."""
    call, out = make()
    err = check_against_reference(wl, call, out) if check else None
    entries.append((cfg_name, wl, impl, call, variant, err))


def record(rec, kind: str, cfg_name: str, wl, impl: str, us: float, timing: str, variant, err) -> dict:
    """Add the row of one timed call on ``wl`` (``kind``: "decode" or "prefill"), with its speed-of-light accounting;
    returns the row."""
    fmt, cfg = wl.fmt, wl.config
    work = attention_work(wl.q, wl.indices, fmt.bytes_per_token, wl.valid_counts)
    a = achieved(us * 1e-6, work, rec.ceilings)
    return rec.add(config=cfg_name, kind=kind, fmt=fmt.id, heads=cfg.num_heads, batch=cfg.batch, s_q=cfg.s_q,
                   topk=cfg.topk, impl=impl, timing=timing, value=us, sol_pct=a["pct_sol"], sol_us=a["sol_us"],
                   tflops=a["tflops"], bytes=work.nbytes, context=cfg.context, variant=variant, rel_err=err)


def time_and_record(rec, entries):
    """Time the prepared calls of one workload interleaved (``Recorder.time_many``: a round of each in turn, so that
    what drifts during the process does not go into their ratios) and record a row for each."""
    if not entries:
        return
    timed = rec.time_many([e[3] for e in entries])
    for (cfg_name, wl, impl, _, variant, err), (us, timing) in zip(entries, timed):
        D.print_row(record(rec, "decode", cfg_name, wl, impl, us, timing, variant, err))


def run_decode(rec, config_names, formats, *, fp8qk=True, peers=True, conv=False, cluster=False, fused=False,
               conv_variants=()):
    """Every (format, configuration): sparsemla, its FP8-QK mode, (``conv``) the forced sm90-conv kernel,
    (``conv_variants``: dicts of ``conv.meta`` options) that kernel built as each variant, (``cluster``) the forced
    sm90-cluster kernel, (``fused``) the plan's kernel merging its splits itself where it can, and the same-format
    peer."""
    from sparsemla.bench import peers as P
    from sparsemla.bench.workload import build_queries, build_workload
    from sparsemla.formats import get_format
    by_batch = {}
    for name in config_names:
        cfg = D.scaled(D.config_named(name), rec.dry)
        by_batch.setdefault((cfg.batch, cfg.context, cfg.s_q), []).append((name, cfg))
    for fname in formats:
        fmt = get_format(fname)
        for (b, ctx, s_q), group in by_batch.items():
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            base = build_workload(group[0][1], fmt, device=rec.device)
            layout, cache = base.layout, base.cache
            print(f"{fname}: cache of {b} x {ctx} tokens ({cache.rows.numel() / 2 ** 30:.2f} GiB)", flush=True)
            for name, cfg in group:
                wl = base if cfg is group[0][1] else build_queries(cfg, cache, layout)
                entries = []  # this workload's calls: each checked, then all timed interleaved
                rec.attempt(f"{name} {fname} sparsemla", lambda: prepare(entries, name, wl, "sparsemla",
                                                                          lambda: ours_call(wl)))
                if fp8qk and fname in FP8QK_FORMATS:
                    rec.attempt(f"{name} {fname} {FP8QK_BACKEND}",
                                lambda: prepare(entries, name, wl, "sparsemla-fp8qk",
                                                lambda: ours_call(wl, FP8QK_BACKEND)))
                if conv and fmt.name in CONV_KINDS and not rec.dry:  # a Gluon kernel: not under the interpreter
                    rec.attempt(f"{name} {fname} {CONV_KERNEL}",
                                lambda: prepare(entries, name, wl, "sparsemla-conv",
                                                lambda: forced_call(wl, CONV_KERNEL)))
                for v in conv_variants:
                    if fmt.name not in CONV_KINDS or rec.dry:
                        continue
                    label = variant_label(v)
                    rec.attempt(f"{name} {fname} {CONV_KERNEL} {label}",
                                lambda: prepare(entries, name, wl, "sparsemla-conv",
                                                lambda: forced_call(wl, CONV_KERNEL, variant=v), variant=label))
                if (cluster and fmt.name in CLUSTER_KINDS and CLUSTER_HEADS[0] <= cfg.num_heads <= CLUSTER_HEADS[1]
                        and not rec.dry):
                    rec.attempt(f"{name} {fname} {CLUSTER_KERNEL}",
                                lambda: prepare(entries, name, wl, "sparsemla-cluster",
                                                lambda: forced_call(wl, CLUSTER_KERNEL)))
                if fused and not rec.dry and fused_applies(wl):  # a Gluon kernel: not under the interpreter
                    rec.attempt(f"{name} {fname} fused",
                                lambda: prepare(entries, name, wl, "sparsemla-fused",
                                                lambda: forced_call(wl, fused_combine=True),
                                                variant="splits merged in the kernel"))
                for peer, fmts in (P.PEER_FORMATS.items() if peers else ()):
                    if fname in fmts:
                        variant = ("heads padded to 64" if peer == "flashmla" and cfg.num_heads < 64 else
                                   "fa3, page size 1" if peer == "flashinfer" else None)
                        rec.attempt(f"{name} {fname} {peer}",
                                    lambda: prepare(entries, name, wl, peer,
                                                    lambda: (P.DECODE_BUILDERS[peer](wl), None),
                                                    variant=variant, check=False))
                rec.attempt(f"{name} {fname} timing", lambda: time_and_record(rec, entries))
                del entries
            del base, cache, layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    D.common_args(ap, formats=ALL_FORMATS)
    ap.add_argument("--heads", default="16,64,128", help="comma list of head counts (configurations D-h<H>)")
    ap.add_argument("--configs", default=None, help="comma list of configuration names instead of --heads "
                    "(e.g. D-h128-mtp,D-k-k1024-h128)")
    ap.add_argument("--no-fp8qk", action="store_true", help="leave out the FP8-QK mode")
    ap.add_argument("--conv", action="store_true", help="add the sm90-conv kernel, forced (sm_90), as impl "
                    "sparsemla-conv")
    ap.add_argument("--cluster", action="store_true", help="add the sm90-cluster kernel, forced (sm_90, Triton "
                    ">= 3.8), as impl sparsemla-cluster")
    ap.add_argument("--fused", action="store_true", help="add the plan's kernel merging its splits in the kernel "
                    "(fused_combine, sm_90) where a call splits, as impl sparsemla-fused")
    ap.add_argument("--conv-variant", action="append", default=[], metavar="K=V[,K=V]",
                    help="add the sm90-conv kernel, forced, built with these conv.meta options (e.g. idx_ahead=1,"
                    "named=1), as impl sparsemla-conv with the options as its variant; repeatable.  For A/B runs: "
                    "write the rows to a file of your own (an ignored folder), not the results file")
    a = ap.parse_args(argv)
    names = a.configs.split(",") if a.configs else [f"D-h{h}" for h in D.int_list(a.heads)]
    rec = D.Recorder(a)
    run_decode(rec, names, D.fmt_list(a.formats), fp8qk=not a.no_fp8qk, peers=not a.no_peers, conv=a.conv,
               cluster=a.cluster, fused=a.fused, conv_variants=[parse_options(v) for v in a.conv_variant])
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
