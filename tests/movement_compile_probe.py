"""Compile the data-movement kernels (cache write, staging, index conversion, indexer) for sm_90 without a
GPU and print, as JSON, per variant: the SASS instruction count and whether the PTX uses NaN-propagating
maxima.  Run in a process without TRITON_INTERPRET (under the interpreter nothing is compiled);
tests/test_movement_compile.py calls it."""
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsemla.formats import all_formats  # noqa: E402
from sparsemla.kernels import cache_write as cw  # noqa: E402
from sparsemla.kernels import convert_indices as ci  # noqa: E402
from sparsemla.kernels import indexer as ix  # noqa: E402
from sparsemla.kernels import staging as st  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def sass_count(cubin: bytes) -> int:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))


def compile_one(fn, types: dict, constexprs: dict, num_warps: int):
    sig = dict(types, **{k: "constexpr" for k in constexprs})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                       options={"num_warps": num_warps})
    return {"sass": sass_count(k.asm["cubin"]), "max_nan": "max.NaN" in k.asm["ptx"]}


def cache_write_variants():
    for fmt in all_formats(compact=True):
        args = dict(cw._format_args(fmt))
        nw = args.pop("num_warps")
        for dt in ("bf16", "fp32"):
            for emulate in (False, True):
                if emulate and dt == "fp32" and fmt.name != "nvfp4_ds_mla":
                    continue
                pairs = dt == "bf16" and fmt.name in ("bf16", "nvfp4_ds_mla")
                cons = dict(args, BLOCK_SIZE=64, KS_MODE=cw.KS_DIV.value if dt == "fp32" else cw.KS_ONE.value,
                            EMULATE=emulate, PAIRS=pairs, ALIGNED=pairs)
                types = {"rows_ptr": "*u8", "kv_ptr": f"*{dt}", "kv_stride": "i32", "pe_ptr": f"*{dt}",
                         "pe_stride": "i32", "slot_ptr": "*i32", "N": "i32", "num_slots": "i32",
                         "block_stride_rows": "i32", "k_scale": "fp32", "inv_k_scale": "fp32"}
                yield f"cache_write/{fmt.id}/{dt}/{'emulate' if emulate else 'cvt'}", cw._cache_write_kernel, types, \
                    cons, nw


def staging_variants():
    for fmt in all_formats(compact=True):
        lay = fmt.layout
        common = dict(FMT=cw.format_id(fmt), ROPE=fmt.rope_dim, BPT=fmt.bytes_per_token,
                      ROPE_OFF=max(lay.rope_offset, 0), SCALE_OFF=max(lay.scale_offset, 0), EMULATE=False)
        types = {"rows_ptr": "*u8", "idx_ptr": "*i32", "stride_it": "i32", "stride_ik": "i32", "vc_ptr": "*i32",
                 "out_ptr": "*u8", "K": "i32", "num_rows": "i32", "k_scale": "fp32", "inv_k_scale": "fp32"}
        for ks in (cw.KS_ONE.value, cw.KS_DIV.value):
            yield f"gather/{fmt.id}/ks{ks}", st._gather_topk_fp8_kernel, types, \
                dict(common, KS_MODE=ks, HAS_VC=True, BK=st.GATHER_ROWS_PER_PROGRAM), st.GATHER_NUM_WARPS
        types = {"rows_ptr": "*u8", "bt_ptr": "*i32", "stride_br": "i32", "stride_bb": "i32", "seq_ptr": "*i32",
                 "ws_ptr": "*i32", "out_ptr": "*bf16", "max_blocks": "i32", "num_blocks": "i32",
                 "block_stride_rows": "i32", "W": "i32", "k_scale": "fp32"}
        bp = st.UPCONVERT_TUNED.get(fmt.name, {}).get("BP", st.UPCONVERT_ROWS_PER_PROGRAM)
        yield f"upconvert/{fmt.id}", st._upconvert_kernel, types, dict(common, BLOCK_SIZE=64, BP=bp), \
            st.UPCONVERT_NUM_WARPS


def index_variants():
    types = {"topk_ptr": "*i32", "stride_tt": "i32", "stride_tk": "i32", "req_ptr": "*i32", "bt_ptr": "*i32",
             "stride_br": "i32", "stride_bb": "i32", "ws_ptr": "*i32", "out_ptr": "*i32", "stride_ot": "i32",
             "cnt_ptr": "*i32", "K": "i32", "R": "i32", "max_blocks": "i32", "block_stride_rows": "i32"}
    for compact in (False, True):
        yield f"convert_indices/compact={compact}", ci._convert_indices_kernel, types, \
            dict(BLOCK_SIZE=64, HAS_WS=True, COMPACT=compact, COUNTS=True, BLOCK=1024), ci.CONVERT_NUM_WARPS
    types = {"k_ptr": "*bf16", "stride_k": "i32", "slot_ptr": "*i32", "cache_ptr": "*u8", "block_stride": "i32",
             "n_tokens": "i32", "num_slots": "i32"}
    yield "index_cache_write", ix._index_cache_write_kernel, types, dict(D=128, PAGE=64, BLOCK_N=8), 4
    types = {"q_ptr": "*u8", "w_ptr": "*fp32", "cache_ptr": "*u8", "bt_ptr": "*i32", "req_ptr": "*i32",
             "ctx_ptr": "*i32", "out_ptr": "*fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_wt": "i32",
             "stride_bt": "i32", "stride_out": "i32", "block_stride": "i32", "max_context": "i32", "n_tiles": "i32",
             "SPLIT": "i32", "n_req": "i32", "max_blocks": "i32", "num_blocks": "i32"}
    yield "index_scores", ix._index_scores_kernel, types, \
        dict(H=64, BLOCK_H=64, D=128, PAGE=64, BLOCK_S=64, INTERPRET=False), 4


def main():
    out = {}
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for gen in (cache_write_variants, staging_variants, index_variants):
        for name, fn, types, cons, nw in gen():
            if only and not name.startswith(only):
                continue
            try:
                out[name] = compile_one(fn, types, cons, nw)
            except Exception as e:  # reported, the test fails on it
                out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
