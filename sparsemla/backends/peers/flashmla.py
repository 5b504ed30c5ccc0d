"""``flashmla``: FlashMLA's Hopper sparse kernels (PyPI ``sgl-flash-mla``, import name ``flash_mla``), optional.

- decode: ``flash_mla_with_kvcache`` on an ``fp8_ds_mla`` cache: 656-byte rows, vLLM's NoPE rows too (the same
  layout with a zero RoPE slot, read as rope rows with q zero-padded to 576 dims, as vLLM does).  The library's
  compact 528-byte NoPE rows are refused: FlashMLA takes that size for its DSv4.1 record.
- prefill: ``flash_mla_sparse_fwd`` on bf16 rows with RoPE (a bf16 cache, or a bf16 workspace); on Hopper
  with ``use_legacy=True`` where the installed build has it (its default path is SM100-only).
- its kernels have 64 or 128 heads: smaller head counts are padded with zero heads (the cost engines pay).

Index convention: FlashMLA names a token ``block * page_block_size + offset`` of its ``k_cache`` tensor.
We hand it the whole row view of our cache (``cache.rows``) cut into pages of 64 rows (or 1 row when the
row count is not a multiple of 64), so FlashMLA's slot number *is* our row number, whatever the cache's
``block_stride_rows``.

The installed interface is detected, never assumed from a version: ``inspect`` says which keyword
arguments exist (``use_legacy``, ``topk_length``, ``kv_format``), and a tiny call on random data,
compared with the float64 reference, confirms that the call works and whether the returned lse is a
natural or a base-2 logarithm.  Runs eagerly (pads heads per call), so it is not offered under capture.
"""
from __future__ import annotations

import inspect
import math
from typing import Dict, Optional

import torch

from ...cache import PagedKVCache
from ...reference import sparse_mla
from .._common import device_index, ensure_outputs, mask_past_counts
from ..registry import AttentionConfig, Backend

LN2 = math.log(2.0)


def _padded_heads(h: int) -> int:
    return 64 if h <= 64 else 128


def _params(fn) -> Dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _takes_no_required_args(fn) -> bool:
    ps = _params(fn).values()
    return all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty for p in ps)


_LEGACY_PREFILL_TOPK = 128  # the Hopper sparse prefill's top-k granularity (`params.topk % (2*B_TOPK) == 0`)


class FlashMLAPeer(Backend):
    name = "flashmla"
    description = "FlashMLA Hopper sparse kernels (sgl-flash-mla), heads padded to 64/128"
    device_types = ("cuda",)
    min_capability = (9, 0)
    max_capability = (9, 0)
    formats = ("fp8_ds_mla", "fp8_ds_mla-nope", "bf16")
    topk_multiple = 64
    graph_safe = False
    device_valid_counts = True

    def __init__(self):
        super().__init__()
        self._probe_device = None  # the device tiny calls run on (None: the current CUDA device)
        self._lse_scale: Dict[object, float] = {}  # probe key -> factor that turns its lse into a natural log

    # --- capability -------------------------------------------------------------------------
    def _extra_why_not(self, c: AttentionConfig):
        if c.mode == "decode":
            if c.kv_source != "cache" or c.fmt.name != "fp8_ds_mla":
                return "its sparse decode reads only an fp8_ds_mla paged cache"
        else:
            if c.fmt.id != "bf16":
                return "its sparse prefill reads only bf16 rows with RoPE (a bf16 cache or a bf16 [rows, 576] workspace)"
        return None

    def probe_key(self, config: Optional[AttentionConfig]):
        if config is None:
            return None
        return (config.mode, config.fmt.id, device_index(self._probe_device))

    def _features(self):
        import flash_mla  # noqa: F401  (ImportError -> reason below)
        feats = {"module": flash_mla}
        for fn_name in ("flash_mla_with_kvcache", "get_mla_metadata", "flash_mla_sparse_fwd"):
            feats[fn_name] = getattr(flash_mla, fn_name, None)
        dec = _params(feats["flash_mla_with_kvcache"]) if feats["flash_mla_with_kvcache"] else {}
        pre = _params(feats["flash_mla_sparse_fwd"]) if feats["flash_mla_sparse_fwd"] else {}
        feats["decode_kwargs"] = set(dec)
        feats["prefill_kwargs"] = set(pre)
        return feats

    def _probe(self, config):
        try:
            feats = self._features()
        except Exception as exc:
            return f"the flash_mla package is not importable ({type(exc).__name__}: {exc}); install sgl-flash-mla"
        if config is None:
            return None
        if config.mode == "decode":
            if feats["flash_mla_with_kvcache"] is None or feats["get_mla_metadata"] is None:
                return "the installed flash_mla has no flash_mla_with_kvcache / get_mla_metadata"
            if "indices" not in feats["decode_kwargs"]:
                return "the installed flash_mla_with_kvcache takes no sparse indices"
        elif feats["flash_mla_sparse_fwd"] is None:
            return "the installed flash_mla has no flash_mla_sparse_fwd"
        if self._probe_device is None and not torch.cuda.is_available():
            return "no CUDA device"
        return self._tiny_call(config)

    def _tiny_call(self, config: AttentionConfig, device=None) -> Optional[str]:
        """Run 2 tokens x 64 heads x top-k 64 on random data against the float64 reference; learn the lse base."""
        device = self._probe_device if device is None else device
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        g = torch.Generator(device="cpu").manual_seed(1234)
        fmt = config.fmt
        cache = PagedKVCache(fmt, 2, 64, dev)
        n = cache.num_slots
        kv_c = torch.randn(n, 512, generator=g).to(dev)
        k_pe = torch.randn(n, fmt.rope_dim, generator=g).to(dev) if fmt.rope_dim else None
        cache.write(kv_c, k_pe, torch.arange(n, device=dev, dtype=torch.int32))
        q = (torch.randn(2, 64, fmt.head_dim, generator=g) * 0.5).to(dev, torch.bfloat16)
        idx = torch.randperm(n, generator=g)[:128].view(2, 64).to(dev, torch.int32)
        idx[1, 40:] = -1
        sm_scale = fmt.head_dim ** -0.5
        key = self.probe_key(config)
        self._lse_scale[key] = 1.0
        kv = cache if config.mode == "decode" else cache.rows.view(torch.bfloat16)
        try:
            out, lse = self.forward(config.mode, q, kv, idx, sm_scale, None, 1.0, None, None)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:
            return f"a tiny {config.mode} call failed ({type(exc).__name__}: {exc})"
        ref_o, ref_l = sparse_mla(q, kv, idx, sm_scale)
        err = ((out.double() - ref_o.double()).norm() / ref_o.double().norm()).item()
        if not err < 2e-2:
            return f"a tiny {config.mode} call disagreed with the float64 reference (relative error {err:.3g})"
        if torch.allclose(lse, ref_l, atol=1e-2, rtol=1e-3):
            return None
        if torch.allclose(lse * LN2, ref_l, atol=1e-2, rtol=1e-3):
            self._lse_scale[key] = LN2  # it returned log2-sum-exp2
            return None
        return f"a tiny {config.mode} call returned an lse that is neither natural nor base-2 log of the reference"

    # --- running --------------------------------------------------------------------------------
    def forward(self, mode, q, kv, indices, sm_scale, valid_counts, k_scale, out, lse, workspace=None):
        feats = self._features()
        out, lse = ensure_outputs(q, out, lse)
        t, h, d = q.shape
        if t == 0:
            return out, lse
        hp = _padded_heads(h)
        key = (mode, "bf16" if mode == "prefill" else kv.fmt.id, device_index(q.device))
        lse_scale = self._lse_scale.get(key, 1.0)
        if mode == "decode":
            o, l = self._decode(feats, q, kv, indices, sm_scale, valid_counts, hp)  # [T, Hp, 512], [T, Hp]
        else:
            o, l = self._prefill(feats, q, kv, indices, sm_scale, valid_counts, hp)
        l = l[:, :h].float() * lse_scale
        # FlashMLA marks a query with no valid entry by lse = +inf (and out 0); our contract says -inf.
        l = torch.where(torch.isposinf(l), torch.full_like(l, float("-inf")), l)
        out.copy_(o[:, :h])
        lse.copy_(l)
        return out, lse

    def _pad_q(self, q, hp):
        if q.shape[1] == hp:
            return q.contiguous()
        qp = torch.zeros((q.shape[0], hp, q.shape[2]), dtype=q.dtype, device=q.device)
        qp[:, : q.shape[1]] = q
        return qp

    def _decode(self, feats, q, cache, indices, sm_scale, valid_counts, hp):
        t, _, d = q.shape
        k = indices.shape[1]
        rows = cache.rows
        page = 64 if rows.shape[0] % 64 == 0 else 1
        k_cache = rows.view(rows.shape[0] // page, page, 1, rows.shape[1])
        kwargs = {"is_fp8_kvcache": True}
        names = feats["decode_kwargs"]
        if "use_legacy" in names:
            kwargs["use_legacy"] = True
        if cache.fmt.rope_dim == 0:  # vLLM's NoPE row: a rope row whose RoPE bytes are zero
            q = torch.cat([q, q.new_zeros(t, q.shape[1], 576 - d)], dim=2)
            d = 576
        idx = indices
        if valid_counts is not None:
            # The Hopper (legacy) V3.2 decode rejects topk_length ("does not support dynamic topk"):
            # apply the counts by masking the tail to -1 instead.
            idx = mask_past_counts(indices, valid_counts)
        kwargs["indices"] = idx.view(t, 1, k).contiguous()
        gm = feats["get_mla_metadata"]
        if _takes_no_required_args(gm):
            meta, num_splits = gm()
        else:  # the older interface plans from per-batch lengths and the head layout
            seqlens = torch.full((t,), k, dtype=torch.int32, device=q.device)
            meta, num_splits = gm(seqlens, hp, 1, hp, True, k)
        qp = self._pad_q(q, hp).view(t, 1, hp, d)
        o, l = feats["flash_mla_with_kvcache"](qp, k_cache, None, None, 512, meta, num_splits, sm_scale, False,
                                               **kwargs)
        # out [T, 1, Hp, 512]; lse [T, Hp, 1]
        return o.view(t, hp, 512), l.reshape(t, hp)

    def _prefill(self, feats, q, kv, indices, sm_scale, valid_counts, hp):
        t, _, d = q.shape
        k = indices.shape[1]
        if isinstance(kv, PagedKVCache):
            kv_b = kv.rows.view(torch.bfloat16)  # bf16 rows: 1152 bytes = 576 bf16
        else:
            kv_b = kv
        kwargs = {}
        if "use_legacy" in feats["prefill_kwargs"]:
            kwargs["use_legacy"] = True  # the Hopper kernel (the default path is SM100-only)
        idx = indices
        if valid_counts is not None:
            if "topk_length" in feats["prefill_kwargs"]:
                kwargs["topk_length"] = valid_counts
            else:
                idx = mask_past_counts(indices, valid_counts)
        idx = idx.view(t, 1, k)
        if kwargs.get("use_legacy") and k % _LEGACY_PREFILL_TOPK:
            # the Hopper kernel walks the top-k list in pairs of 64-entry blocks and asserts a multiple of 128:
            # pad with -1 (no token)
            pad = idx.new_full((t, 1, -k % _LEGACY_PREFILL_TOPK), -1)
            idx = torch.cat([idx, pad], dim=2)
        qp = self._pad_q(q, hp)
        res = feats["flash_mla_sparse_fwd"](qp, kv_b.unsqueeze(1), idx.contiguous(), sm_scale, 512, **kwargs)
        o, l = res[0], res[2]  # (out [T, Hp, 512], max_logits, lse [T, Hp], ...)
        return o, l

