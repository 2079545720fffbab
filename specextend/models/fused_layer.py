"""Fused decode-time layer kernels (Triton) for the full-step graphs: 10 kernels per layer instead
of 22 (float32; 26 in bf16 with the casts to the float32 compute dtype; benchmarks/kernel_count.py). A
graphed forward of a few tokens is bound by its count of small kernels (benchmarks/README.md at 77940b1: ~750
graph nodes per 0.5B draft forward, ~2.5 us each, against 0.3 ms of weights).

    rope_scatter   RoPE on q and k, the per-head copies of q, k, v (and pre-RoPE k)   ~7 -> 1
    tree_combine   HTA's tree part with its mask and the merge of the S prefix partials,
                   written in the o-projection's [T, H * D] layout                      ~10 -> 1
    silu_mul       the MLP's activation                                                    2 -> 1
    rms_norm       the two norms, one program per row (PyTorch's took 5.8 us for 17 rows)  1 -> 1

A model under the fused plan has its two norms' weights folded into the products after them
(fold_model_norms, at load): the rms_norm kernels leave the plan and rope_scatter / silu_mul
apply each row's 1/RMS, 8 kernels a layer.

The slow twins are the torch functions the plain segments use (decoder.layer_pre / layer_post,
tree_merge.tree_attention_merged); tests compare each kernel with its twin and the whole fused
forward with Decoder.forward_eager, on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F

from specextend import pdl
from specextend.models.args import ModelArgs
from specextend.pdl import launch_args
from specextend.models import skinny as skinny_mod
from specextend.models.decoder import LayerWeights
from specextend.models.skinny import supported as skinny_rows

def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (n - 1).bit_length())


def combine_config(rows: int, n: int, d: int, s: int, ieee: bool) -> dict:
    """tree_combine's tiles: row blocks of 16 and head-dim chunks of 16, so that even an AR step's
    few rows spread over G * D / 16 programs (the S float32 partials are read at the machine's
    bandwidth, not a few multiprocessors'), and in half precision sb = every split: their outputs
    in one load where more than 16 are in use, else rounds of 8 (docs/architecture.md, "Kernels";
    float32 reads one split an iteration). Key blocks
    of 64 for the tree part (16 for float32's IEEE dots on CUDA cores). Tiles that compile for sm_90
    without spilling (benchmarks/triton_aot.py)."""
    bn = 16 if ieee else min(64, _pow2(n))
    return dict(bm=16, bn=bn, dc=min(32 if ieee else 16, _pow2(d)), sp=_pow2(s, 2), sb=1 if ieee else _pow2(s, 2), warps=8 if ieee else 4)


def tree_combine(q: torch.Tensor,  # [H, T, D] contiguous
                 k: torch.Tensor, v: torch.Tensor,  # [G, n, D], last dim contiguous
                 bias: torch.Tensor,  # [(H/G) * T, n] additive mask (tree_merge.mask_bias), contiguous
                 out_p: torch.Tensor,  # [G, S, (H/G) * T, D] prefix partials (or [H, T, D]: S = 1)
                 lse_p: torch.Tensor,  # [G, S, (H/G) * T] (or [H, T])
                 scale: float, need_lse: bool = False,
                 d_chunk: int = 0, sb: int = 0, warps: int = 0,
                 key_ranges: Optional[torch.Tensor] = None,  # [T, 4] int32 (full_graphs.batch_key_ranges)
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """-> attention over prefix + tree keys as [T, H * D] (q's dtype) and the merged lse [H, T]
    (float32) if need_lse. d_chunk (a power of two >= 16; 0 = combine_config's) splits the head dim
    over programs; sb, warps (0 = combine_config's): benchmarks/decode_attention.py's sweep.
    `key_ranges`: each token's two key ranges outside which the mask is false (a batched forward's
    block-diagonal mask): each row block reads only its tokens' ranges. Twin:
    tree_merge.tree_attention_merged (its out, transposed), which reads every key."""
    from specextend.attention._triton_kernels import INTERPRETED
    from specextend.models._triton_layer import tree_combine as kernel

    h, t, d = q.shape
    g, n, _ = k.shape
    r = h // g
    s = 1 if out_p.dim() == 3 else out_p.shape[1]
    assert q.is_contiguous() and bias.is_contiguous() and out_p.is_contiguous() and lse_p.is_contiguous()
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.dtype == v.dtype == q.dtype
    out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)  # [T, H * D]
    lse = torch.empty(h, t, dtype=torch.float32, device=q.device) if need_lse else out
    ieee = q.dtype == torch.float32
    c = combine_config(r * t, n, d, s, ieee)
    dc, sb, warps = d_chunk or c["dc"], sb or c["sb"], warps or c["warps"]
    grid = (-(-r * t // c["bm"]), g, -(-d // dc))
    on = pdl.enabled(q.device)
    if key_ranges is not None:
        assert key_ranges.shape == (t, 4) and key_ranges.dtype == torch.int32 and key_ranges.is_contiguous()
    kernel[grid](q, k, v, bias, out_p, lse_p, out, lse, bias if key_ranges is None else key_ranges,
                 scale * math.log2(math.e),
                 k.stride(0), k.stride(1), v.stride(0), v.stride(1), T=t, N=n, S=s, R=r, SP=c["sp"], D=d,
                 DP=_pow2(d), DC=dc, BLOCK_M=c["bm"], BLOCK_N=c["bn"], SB=sb, NEED_LSE=need_lse, IEEE=ieee,
                 INTERPRET=INTERPRETED, PDL=on, HAS_RNG=key_ranges is not None, num_warps=warps, num_stages=1,
                 **launch_args(on))
    return out, (lse if need_lse else None)


def rope_scatter(a: ModelArgs, qkv: torch.Tensor,  # [T, (H + 2G) * D] contiguous
                 cos: torch.Tensor, sin: torch.Tensor,  # [T, D] (Rope.cos_sin: signed sine)
                 k_dst: torch.Tensor, v_dst: torch.Tensor,  # [G, T, D], last dim contiguous
                 kpre_dst: Optional[torch.Tensor],
                 norm_x: Optional[torch.Tensor] = None,  # [T, E] contiguous: qkv scaled by its rows' 1/RMS
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:  # [(H + 2G) * D], with norm_x
    """RoPE and the head copies in one kernel -> q [H, T, D] (k, v, pre-RoPE k into the dsts).
    With norm_x (folded norms, fold_norms), qkv is x @ (W * w_norm).T: each row is first scaled by
    its 1/RMS of norm_x and the bias added. Twin: decoder.layer_pre's split and apply_rope plus
    segments._pre's copies."""
    from specextend.models._triton_layer import rope_scatter as kernel

    t = qkv.shape[0]
    h, g, d = a.num_heads, a.num_kv_heads, a.head_dim
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert k_dst.stride(-1) == 1 and v_dst.stride(-1) == 1
    q = torch.empty(h, t, d, dtype=qkv.dtype, device=qkv.device)
    pre = kpre_dst if kpre_dst is not None else k_dst
    on = pdl.enabled(qkv.device)
    e = norm_x.shape[1] if norm_x is not None else 1
    assert norm_x is None or norm_x.is_contiguous()
    kernel[(t, h + 2 * g)](qkv, cos, sin, q, k_dst, v_dst, pre, k_dst.stride(0), k_dst.stride(1),
                           v_dst.stride(0), v_dst.stride(1), pre.stride(0), pre.stride(1),
                           T=t, H=h, G=g, D=d, DP=_pow2(d, 2), STORE_PRE=kpre_dst is not None, PDL=on,
                           x_ptr=qkv if norm_x is None else norm_x, b_ptr=qkv if bias is None else bias,
                           eps=float(a.rms_norm_eps) if norm_x is not None else 0.0, E=e, EP=_pow2(e, 1),
                           NORM=norm_x is not None, BIAS=bias is not None, num_warps=1, **launch_args(on))
    return q


def silu_mul(gu: torch.Tensor, norm_x: Optional[torch.Tensor] = None, eps: float = 0.0) -> torch.Tensor:
    """gu [T, 2I] contiguous -> silu(gate) * up [T, I]. With norm_x [T, E] (folded norms,
    fold_norms), gu is x @ (W * w_norm).T: gate and up are first scaled by their row's 1/RMS of
    norm_x. Twin: F.silu(gate) * up."""
    from specextend.models._triton_layer import silu_mul as kernel

    t, i2 = gu.shape
    i = i2 // 2
    out = torch.empty(t, i, dtype=gu.dtype, device=gu.device)
    block = min(1024, _pow2(i))
    e = norm_x.shape[1] if norm_x is not None else 1
    assert norm_x is None or norm_x.is_contiguous()
    kernel[(t, -(-i // block))](gu, out, I=i, BLOCK=block, x_ptr=gu if norm_x is None else norm_x, eps=float(eps),
                                E=e, EP=_pow2(e, 1), NORM=norm_x is not None, num_warps=4)
    return out


class FoldedLayerWeights(LayerWeights):
    """A layer whose input_norm and post_norm weights are folded into qkv's and gate_up's columns
    (fold_norms) and are ones: the fused plan applies the norms' 1/RMS after those products; every
    other path runs the norms as written (with unit weights) and computes the same function."""


def fold_norms(lw: LayerWeights) -> FoldedLayerWeights:
    """The layer with its two RMSNorms' weights folded into the columns of the products after them:
    qkv * w_in and gate_up * w_post (computed in float32, rounded once), the norms' weights then
    ones, so that the norm kernels leave a fused forward (layer_pre / layer_post scale the products'
    rows by 1/RMS inside rope_scatter and silu_mul: 10 kernels a layer -> 8) while the eager path,
    the piecewise plans and the persistent layer compute the same function with the folded weights.
    A folded layer differs from the original by the folded weights' rounding (docs/architecture.md,
    "Kernels"). Idempotent."""
    if isinstance(lw, FoldedLayerWeights):
        return lw
    if lw.q_norm is not None:
        raise ValueError("folded norms take models without QK-norm")

    def fold(w: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:  # w [N, E], nw [E]
        return (w.float() * nw.float()[None, :]).to(w.dtype).contiguous()
    fields = {f.name: getattr(lw, f.name) for f in dataclasses.fields(lw)}
    fields.update(qkv=fold(lw.qkv, lw.input_norm), gate_up=fold(lw.gate_up, lw.post_norm),
                  input_norm=torch.ones_like(lw.input_norm), post_norm=torch.ones_like(lw.post_norm))
    return FoldedLayerWeights(**fields)


def fold_model_norms(model) -> None:
    """Folds every layer of the model's weights in place (fold_norms), one layer at a time, so the
    original qkv and gate_up are freed as their folded copies are made (a layer's worth of memory
    at most, where nothing else holds them)."""
    layers = model.w.layers
    for i in range(len(layers)):
        layers[i] = fold_norms(layers[i])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, E] contiguous, w [E] -> RMSNorm [T, E], one program per row (PyTorch's kernel took
    5.8 us for 17 rows of 4096 on an H100, 2026-11-23: 65 of them per 8B forward). Twin:
    decoder.rms_norm."""
    from specextend.models._triton_layer import rms_norm as kernel

    t, e = x.shape
    assert x.is_contiguous() and w.is_contiguous() and w.shape == (e,)
    out = torch.empty_like(x)
    block = _pow2(e)
    kernel[(t,)](x, w, out, eps, E=e, BLOCK=block, num_warps=max(1, min(16, block // 512)))
    return out


# ---------------------------------------------------------------- the layer pieces, fused
def layer_pre(a: ModelArgs, lw: LayerWeights, x, cos, sin, k_dst, v_dst, kpre_dst, skinny: bool = False) -> torch.Tensor:
    """segments._pre with RoPE and the copies fused, for models without QK-norm; `skinny`: the norm
    and the QKV projection (+ bias) in one kernel too (skinny.norm_linear) where it was measured
    faster at this shape (skinny.choose)."""
    assert lw.q_norm is None, "QK-norm models take segments._pre"
    eps = a.rms_norm_eps
    if isinstance(lw, FoldedLayerWeights):  # the norm's weight in qkv's columns; its 1/RMS, the bias: rope_scatter
        qkv = torch.mm(x, lw.qkv.t())  # [T, (H + 2G) * D]
        return rope_scatter(a, qkv, cos, sin, k_dst, v_dst, kpre_dst, norm_x=x, bias=lw.qkv_bias)
    tile = _skinny_tile("qkv", x, lw.qkv, lw.input_norm, lw.qkv_bias, eps) if skinny else None
    if tile is not None:
        qkv = skinny_mod.norm_linear(x, lw.input_norm, eps, lw.qkv, lw.qkv_bias, tile)  # [T, (H + 2G) * D]
    else:
        qkv = F.linear(rms_norm(x, lw.input_norm, eps), lw.qkv, lw.qkv_bias)
    return rope_scatter(a, qkv, cos, sin, k_dst, v_dst, kpre_dst)


def layer_post(a: ModelArgs, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor, skinny: bool = False) -> torch.Tensor:
    """decoder.layer_post on attention already in [T, H * D] (tree_combine's layout). The residual
    adds are in place (x is this layer's own input, read by nothing after it): torch.addmm into a
    new tensor first copies x there, two extra graph nodes a layer (memcpy32_post in the H100
    profile, 2026-11-23). `skinny`: each projection through skinny.py where it was measured faster
    at this shape (three kernels instead of six when all three are)."""
    eps = a.rms_norm_eps
    if isinstance(lw, FoldedLayerWeights):  # the norm's weight in gate_up's columns; its 1/RMS: silu_mul
        x = x.addmm_(attn, lw.o.t())
        act = silu_mul(torch.mm(x, lw.gate_up.t()), norm_x=x, eps=eps)  # [T, I]
        return x.addmm_(act, lw.down.t())
    tile = _skinny_tile("res", attn, lw.o, None, None, eps) if skinny else None
    x = skinny_mod.linear_residual_(x, attn, lw.o, tile) if tile is not None else x.addmm_(attn, lw.o.t())
    tile = _skinny_tile("glu", x, lw.gate_up, lw.post_norm, None, eps) if skinny else None
    if tile is not None:
        act = skinny_mod.norm_glu(x, lw.post_norm, eps, lw.gate_up, tile)  # [T, I]
    else:
        act = silu_mul(F.linear(rms_norm(x, lw.post_norm, eps), lw.gate_up))
    tile = _skinny_tile("res", act, lw.down, None, None, eps) if skinny else None
    return skinny_mod.linear_residual_(x, act, lw.down, tile) if tile is not None else x.addmm_(act, lw.down.t())


def _skinny_tile(kind: str, x: torch.Tensor,  # [T, K] the projection's input
                 w: torch.Tensor,  # [N (2N for glu), K]
                 nw: Optional[torch.Tensor], b: Optional[torch.Tensor], eps: float) -> Optional[skinny_mod.Tile]:
    """skinny.choose for one projection, with the ordinary ops it replaces as the twin that it is
    timed against (both on scratch copies of the inputs: timing never touches the forward's
    tensors). None: the ordinary ops (also where the skinny kernels do not take these rows)."""
    if not skinny_rows(x, w):
        return None
    n = w.shape[0] // 2 if kind == "glu" else w.shape[0]
    scratch: dict = {}

    def s() -> dict:
        if not scratch:
            scratch["x"] = x.detach().clone()  # [T, K]
            scratch["y"] = torch.randn(x.shape[0], n, device=x.device).to(x.dtype)  # [T, N] residual
        return scratch

    if kind == "qkv":
        def twin(ww):
            F.linear(rms_norm(s()["x"], nw, eps), ww, b)

        def kernel(ww, c):
            skinny_mod.norm_linear(s()["x"], nw, eps, ww, b, c)
    elif kind == "glu":
        def twin(ww):
            silu_mul(F.linear(rms_norm(s()["x"], nw, eps), ww))

        def kernel(ww, c):
            skinny_mod.norm_glu(s()["x"], nw, eps, ww, c)
    else:
        def twin(ww):
            s()["y"].addmm_(s()["x"], ww.t())

        def kernel(ww, c):
            skinny_mod.linear_residual_(s()["y"], s()["x"], ww, c)
    return skinny_mod.choose(kind, x, w, twin, kernel, n)
