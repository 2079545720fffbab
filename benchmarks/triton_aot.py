"""Compile every Triton kernel of the decode-time graphs ahead of time for a GPU architecture, on any
machine (no GPU needed: Triton ships ptxas), at the shapes the product's models use; report
registers, spills, shared memory and whether the dots became Hopper wgmma instructions.

    python benchmarks/triton_aot.py [--arch 90] [--quick]

Catches what Triton's CPU interpreter cannot: a kernel that does not compile for the real target
(non-constexpr globals, dot shapes, layouts, shared memory over the limit) and one that spills to
local memory (reported; a row fails on the first two). The launch arguments
mirror the wrappers (attention/triton_prefix.py, models/fused_layer.py), with the runtime's
specialization of 16-aligned pointers and 16-divisible integers. Must run without TRITON_INTERPRET.
Prints a table, then the full JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("triton_aot.py compiles for a GPU: run it without TRITON_INTERPRET=1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from specextend.attention import _triton_kernels as PK  # noqa: E402
from specextend.bench.compile_keys import unspecialized  # noqa: E402
from specextend.attention.triton_prefix import config, num_splits  # noqa: E402
from specextend.models import _triton_layer as LK  # noqa: E402
from specextend.models.fused_layer import _pow2, combine_config  # noqa: E402
from specextend.attention.triton_prefix import MIN_CHUNK  # noqa: E402
from specextend.models import _triton_skinny as SK  # noqa: E402
from specextend.models.skinny import config as skinny_config  # noqa: E402
from specextend.models.skinny import k_slice as skinny_slice, streamed_tile as skinny_streamed  # noqa: E402
from specextend.draft import _triton_topk as TK  # noqa: E402
from specextend.models import _triton_persist as PER  # noqa: E402
from specextend.models import persistent as PER_MOD  # noqa: E402
from specextend.models.persistent import MAX_ROWS as PERSIST_ROWS  # noqa: E402
from specextend.draft.vocab_topk import BLOCK as TOPK_BLOCK, MAX_W  # noqa: E402

# name: (H, G, D, intermediate) of the presets (models/presets.py)
GEOMETRIES = {"llama-3.1-8b": (32, 8, 128, 14336), "llama-3.2-1b": (32, 8, 64, 8192),
              "llama-68m": (12, 12, 64, 3072), "qwen2.5-0.5b": (14, 2, 64, 4864),
              "qwen2.5-1.5b": (12, 2, 128, 8960)}
# call kinds: (T queries, N tree keys incl. staged)
CALLS = {"ar": (1, 1), "verify16": (17, 17), "verify50": (51, 51), "draft-level": (4, 20)}
H100_SMS = 132
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90


def _sig(fn, args: dict, constexprs: dict):
    """ASTSource with the runtime's specialization: pointers and 16-divisible ints get divisibility 16
    (not the ints the kernel says not to specialize on)."""
    sig, attrs = {}, {}
    fixed = unspecialized(fn)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        kind, value = args[name]
        sig[name] = kind
        if kind.startswith("*") or (kind in ("i32", "i64") and value % 16 == 0 and name not in fixed):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)


def kernels_for(geo: str, call: str, dt: str):
    h, g, d, inter = GEOMETRIES[geo]
    t, n = CALLS[call]
    r = h // g
    m = r * t
    c = config(m, dt == "fp32", d)
    splits = num_splits(m, g, H100_SMS, dt == "fp32")
    p = f"*{dt}"
    yield "prefix_partials", PK.prefix_partials, dict(
        q_ptr=(p, 0), kv_ptr=(p, 0), meta_ptr=("*i64", 0), out_ptr=("*fp32", 0), lse_ptr=("*fp32", 0),
        scale_log2=("fp32", 0), layer=("i32", 3), M=("i32", m), T=("i32", t), NB=("i32", 1),
        SPLITS=("i32", splits)), dict(G=g, D=d, DP=_pow2(d), BLOCK_M=c["bm"], BLOCK_N=c["block_n"], MIN_CHUNK=MIN_CHUNK, IEEE=dt == "fp32",
        INTERPRET=False, PDL=True), dict(num_warps=c["num_warps"], num_stages=c["num_stages"], launch_pdl=True)
    cc = combine_config(m, n, d, splits, dt == "fp32")
    # (HAS_RNG on the verifications: a batched forward's per-token key ranges, full_graphs.batch_key_ranges)
    yield "tree_combine", LK.tree_combine, dict(
        q_ptr=(p, 0), k_ptr=(p, 0), v_ptr=(p, 0), bias_ptr=("*fp32", 0), outp_ptr=("*fp32", 0),
        lsep_ptr=("*fp32", 0), out_ptr=(p, 0), lse_ptr=("*fp32", 0), rng_ptr=("*i32", 0), scale_log2=("fp32", 0),
        stride_kg=("i32", n * d), stride_kn=("i32", d), stride_vg=("i32", n * d), stride_vn=("i32", d),
        T=("i32", t), N=("i32", n), S=("i32", splits)), dict(R=r, SP=cc["sp"], D=d, DP=_pow2(d), DC=cc["dc"], BLOCK_M=cc["bm"], BLOCK_N=cc["bn"],
        SB=cc["sb"], NEED_LSE=call.startswith("verify"), IEEE=dt == "fp32", INTERPRET=False, PDL=True,
        HAS_RNG=call.startswith("verify")), dict(num_warps=cc["warps"], num_stages=1, launch_pdl=True)
    block = min(1024, _pow2(inter))
    for folded in (True, False):  # norms folded (fused_layer.fold_model_norms), as loaded; QK-norm models not
        yield "rope_scatter", LK.rope_scatter, dict(
            qkv_ptr=(p, 0), cos_ptr=(p, 0), sin_ptr=(p, 0), q_ptr=(p, 0), k_ptr=(p, 0), v_ptr=(p, 0),
            kpre_ptr=(p, 0), stride_kg=("i32", n * d), stride_kt=("i32", d), stride_vg=("i32", n * d),
            stride_vt=("i32", d), stride_pg=("i32", t * d), stride_pt=("i32", d), T=("i32", t),
            x_ptr=(p, 0), b_ptr=(p, 0), eps=("fp32", 0)), dict(
            H=h, G=g, D=d, DP=_pow2(d, 2), STORE_PRE=call == "draft-level", PDL=True, E=h * d, EP=_pow2(h * d, 1),
            NORM=folded, BIAS=folded), dict(num_warps=1, launch_pdl=True)
        yield "silu_mul", LK.silu_mul, dict(gu_ptr=(p, 0), out_ptr=(p, 0), x_ptr=(p, 0), eps=("fp32", 0)), dict(
            I=inter, BLOCK=block, E=h * d, EP=_pow2(h * d, 1), NORM=folded), dict(num_warps=4)
    e = h * d  # the presets' hidden size
    # the skinny projections (models/skinny.py): QKV with the norm and bias, gate/up, down + residual
    for what, n, k, norm, bias, glu, res in (("qkv", (h + 2 * g) * d, e, True, True, False, False),
                                             ("gate_up", inter, e, True, False, True, False),
                                             ("down", e, inter, False, False, False, True)):
        sc = skinny_config(t, n, k, "res" if res else ("glu" if glu else "qkv"), dt == "fp32")
        yield "skinny_linear", SK.skinny_linear, dict(
            x_ptr=(p, 0), nw_ptr=(p, 0), w_ptr=(p, 0), b_ptr=(p, 0), y_ptr=(p, 0), ws_ptr=("*fp32", 0),
            cnt_ptr=("*i32", 0), eps=("fp32", 0), T=("i32", t)), dict(
            K=k, N=n, NORM=norm, BIAS=bias, GLU=glu, RESIDUAL=res, IEEE=dt == "fp32", BT=sc["BT"], BN=sc["BN"],
            KS=sc["KS"], KSP=sc["KSP"], SPLIT=sc["SPLIT"], BKX=sc["BKX"], PDL=True, LATE=False), dict(
            num_warps=sc["num_warps"], launch_pdl=True)
        if dt == "fp32":  # the streamed kernel's float32 IEEE dots at 64 rows spill at bk 128: a start-up
            continue  # candidate only, timed against the ordinary ops (skinny.choose), never forced
        st = skinny_streamed(n, k, 16)  # the streamed kernel at the start-up candidates' first tile
        ks, _, split = skinny_slice("res", t, k, st)
        yield "skinny_loop", SK.skinny_loop, dict(
            x_ptr=(p, 0), nw_ptr=(p, 0), w_ptr=(p, 0), b_ptr=(p, 0), y_ptr=(p, 0), ws_ptr=("*fp32", 0),
            cnt_ptr=("*i32", 0), eps=("fp32", 0), T=("i32", t)), dict(
            K=k, N=n, NORM=norm, BIAS=bias, GLU=glu, RESIDUAL=res, IEEE=dt == "fp32", BT=sc["BT"], BN=st.bn,
            KS=ks, BK=st.bk, SPLIT=split, STAGES=st.stages, BKX=sc["BKX"], PDL=True, LATE=False), dict(
            num_warps=st.warps, launch_pdl=True)
    if t <= PERSIST_ROWS:  # the persistent layer kernel (models/persistent.py), all stages in one launch
        bc = PER_MOD.BLOCK_COLS
        pointers = ("x nw1 wqkv bqkv cos sin q k v kp kv kt vt attn wo nw2 wgu act wd").split()
        strides = dict(skg=n * d, skt=d, svg=n * d, svt=d, spg=t * d, spt=d, stg=n * d, stn=d, svtg=n * d, svtn=d)
        args = {**{f"{x}_ptr": (p, 0) for x in pointers}, **{k: ("i32", v) for k, v in strides.items()},
                "meta_ptr": ("*i64", 0), "layer": ("i32", 3), "outp_ptr": ("*fp32", 0), "lsep_ptr": ("*fp32", 0),
                "bias_ptr": ("*fp32", 0), "lse_ptr": ("*fp32", 0), "sync_ptr": ("*i32", 0), "eps": ("fp32", 0),
                "scale_log2": ("fp32", 0)}
        yield "layer_kernel", PER.layer_kernel, args, dict(
            T=t, E=e, H=h, G=g, D=d, DP=_pow2(d), I=inter, N=n, S=splits, SP=cc["sp"], BT=max(16, _pow2(t)), BC=bc,
            BN=PER_MOD.BLOCK_COLS, BK=PER_MOD.BLOCK_K, PBM=c["bm"], PBN=c["block_n"], MIN_CHUNK=MIN_CHUNK, CBM=cc["bm"], CBN=cc["bn"], DC=cc["dc"],
            SB=cc["sb"], HAS_BIAS=True, STORE_PRE=call == "draft-level", NEED_LSE=call == "ar", IEEE=dt == "fp32",
            INTERPRET=False, STAGE=-1, KS=PER_MOD.K_STAGES), dict(num_warps=cc["warps"], launch_cooperative_grid=True)
    yield "rms_norm", LK.rms_norm, dict(x_ptr=(p, 0), w_ptr=(p, 0), out_ptr=(p, 0), eps=("fp32", 0)), dict(
        E=e, BLOCK=_pow2(e)), dict(num_warps=max(1, min(16, _pow2(e) // 512)))


def topk_kernels(vocab: int, dt: str):
    """The draft's vocabulary top-k (draft/vocab_topk.py) at one vocabulary, for the widths the
    product uses (tree_topk 4, the overlap's 2 x 4) and the widest it takes."""
    nb = -(-vocab // TOPK_BLOCK)
    for w in sorted({4, 8, MAX_W}):
        yield "block_topk", TK.block_topk, dict(
            logits_ptr=(f"*{dt}", 0), row_stride=("i32", vocab), cand_v_ptr=("*fp32", 0), cand_i_ptr=("*i32", 0),
            stat_ptr=("*fp32", 0)), dict(V=vocab, NB=nb, W=w, BLOCK=TOPK_BLOCK), dict(num_warps=8)
        if dt == "bf16":  # the merge reads float32 candidates whatever the logits' dtype
            yield "merge_topk", TK.merge_topk, dict(
                cand_v_ptr=("*fp32", 0), cand_i_ptr=("*i32", 0), stat_ptr=("*fp32", 0), out_v_ptr=("*fp32", 0),
                out_i_ptr=("*i64", 0)), dict(NB=nb, NBP=_pow2(nb, 1), W=w, CP=_pow2(nb * w, 1)), dict(num_warps=1)


def resource_usage(cubin: bytes) -> dict:
    """REG, STACK (bytes of local memory per thread: spills and local arrays), LOCAL, SHARED of the
    kernel, from the cuobjdump that Triton's NVIDIA backend bundles."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", out)}


def compile_one(fn, args, constexprs, options, arch: int) -> dict:
    t0 = time.perf_counter()
    k = triton.compile(_sig(fn, args, constexprs), target=GPUTarget("cuda", arch, 32), options=options)
    use = resource_usage(k.asm["cubin"])
    ptx = k.asm["ptx"]
    return dict(regs=use.get("reg"), stack=use.get("stack", 0) + use.get("local", 0), shared=k.metadata.shared,
                wgmma="wgmma" in ptx, mma="mma.sync" in ptx or "wgmma" in ptx,
                compile_s=round(time.perf_counter() - t0, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100/H200)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--quick", action="store_true", help="the 8B and 0.5B geometries only")
    a = ap.parse_args()
    geos = ["llama-3.1-8b", "qwen2.5-0.5b"] if a.quick else list(GEOMETRIES)
    dtypes = a.dtypes.split(",")
    rows, seen = [], set()
    print("| kernel | geometry | call | dtype | registers | local bytes (spills) | shared bytes | tensor cores | "
          "wgmma | compile s | ok |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for geo in geos:
        for call in CALLS:
            for dt in dtypes:
                for name, fn, args, const, opts in kernels_for(geo, call, dt):
                    key = (name, json.dumps(const, sort_keys=True), dt, json.dumps(opts))
                    if key in seen:  # (silu_mul does not depend on the call)
                        continue
                    seen.add(key)
                    try:
                        res = compile_one(fn, args, const, opts, a.arch)
                        res["ok"] = res["shared"] <= SMEM_LIMIT
                    except Exception as e:  # noqa: BLE001 - reported in the table
                        res = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                    rows.append(dict(kernel=name, geometry=geo, call=call, dtype=dt, **res))
                    r = rows[-1]
                    print(f"| {name} | {geo} | {call} | {dt} | {r.get('regs')} | {r.get('stack')} | "
                          f"{r.get('shared')} | {r.get('mma')} | {r.get('wgmma')} | {r.get('compile_s')} | {r['ok']} "
                          f"{r.get('error', '')} |", flush=True)
    vocabs = ((151936, "qwen2.5 vocabulary"),) + (() if a.quick else ((128256, "llama-3 vocabulary"),))
    for vocab, geo in vocabs:
        for dt in dtypes:
            for name, fn, args, const, opts in topk_kernels(vocab, dt):
                try:
                    res = compile_one(fn, args, const, opts, a.arch)
                    res["ok"] = res["shared"] <= SMEM_LIMIT
                except Exception as e:  # noqa: BLE001 - reported in the table
                    res = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                rows.append(dict(kernel=f"{name} w={const['W']}", geometry=geo, call="draft top-k", dtype=dt, **res))
                r = rows[-1]
                print(f"| {r['kernel']} | {geo} | draft top-k | {dt} | {r.get('regs')} | {r.get('stack')} | "
                      f"{r.get('shared')} | {r.get('mma')} | {r.get('wgmma')} | {r.get('compile_s')} | {r['ok']} "
                      f"{r.get('error', '')} |", flush=True)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} kernels compiled for sm_{a.arch}: {len(bad)} failed or over the shared-memory limit, "
          f"{sum(1 for r in rows if r.get('stack'))} use local memory (spills)")
    print(json.dumps(dict(arch=a.arch, triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
                          smem_limit=SMEM_LIMIT, rows=rows)))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
