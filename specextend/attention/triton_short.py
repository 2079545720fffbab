"""Hybrid Tree Attention in one Triton kernel for a short committed cache (docs/architecture.md,
*Kernels*).

The split path (prefix_partials, then fused_layer.tree_combine) spreads a long prefix over many
programs and merges their partials in a second kernel. The draft's retrieval working cache is short
(a selection of ~1K keys plus the tokens appended between refreshes), and there the split, the
partials' round trip through memory and the second launch cost more than they save. Here one
program per (row block, KV head) runs one online softmax over every committed key and then the
staged tree keys with their mask, and writes the final output in the o-projection's layout
[T, H * D] (and the merged LSE when asked), as tree_combine does. The committed cache is found
through the same device-side `meta` as prefix_partials (triton_prefix.cache_meta), so a CUDA graph
that captured the launch serves any session and any committed length L: always correct, fast while
L is short. Which plans take it is decided once per plan (full_graphs.FullStepGraphs.short_cache).

GQA folding as in the other kernels: the H/G query heads of a group are rows (q [H, T, D] viewed as
[G, (H/G) * T, D]), so each key block is read once per row block for all of them.

The slow twin is `short_reference` (partials_reference with one split, then
tree_merge.tree_attention_merged: plain torch); tests compare the kernel with it and with the split
path on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from specextend.attention.eager import compute_dtype
from specextend.attention.tree_merge import tree_attention_merged
from specextend.attention.triton_prefix import partials_reference

# The longest committed length (keys) for which a plan takes this kernel instead of the split
# path: a static promise of the cache's owner (KVCache.working_length) is compared with it.
SHORT_MAX_KEYS = 2048


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def config(rows: int, n: int, d: int, ieee: bool = False) -> dict:
    """Launch parameters by folded rows (R * T), tree keys n and head dim d.

    Row blocks of 16 (the smallest tensor-core tile): each program streams its KV head's whole
    committed cache, so a program's time is about L keys' bytes at one multiprocessor's bandwidth
    plus its dots, and its dots grow with its rows; more programs of fewer rows (the draft's 56 to
    448 rows: 4 to 28 per KV head) stream the same bytes in parallel, from L2. Key blocks of 128
    for 64-dim heads (3 stages: two blocks of K and V, 64 KB, in flight per program to cover L2's
    latency), 64 for 128-dim ones (the same bytes). Tree-key blocks of 32: at 64 some shapes spill
    (16 bytes at 72 or 80 keys). float32 (IEEE dots on CUDA cores): 8 warps and blocks of 16 to 32
    keys, the tiles that compile without spilling. All checked for sm_90 by benchmarks/triton_aot.py;
    not yet timed on a GPU: benchmarks/short_attention.py sweeps them."""
    tree_n = min(16 if ieee else 32, _pow2(n))
    if ieee:
        return dict(bm=16, block_n=32 if d <= 64 else 16, tree_n=tree_n, num_warps=8, num_stages=2)
    return dict(bm=16, block_n=128 if d <= 64 else 64, tree_n=tree_n, num_warps=4, num_stages=3)


def short_attention(q: torch.Tensor,  # [H, T, D] contiguous
                    anchor: torch.Tensor,  # the cache's dtype: meta[0] counts elements from here
                    meta: torch.Tensor,  # [4] int64 on q's device, from triton_prefix.cache_meta
                    layer: int,
                    k: torch.Tensor, v: torch.Tensor,  # [G, n, D] staged tree keys, last dim contiguous
                    bias: torch.Tensor,  # [(H/G) * T, n] additive mask (tree_merge.mask_bias), contiguous
                    scale: float, need_lse: bool = False,
                    out: Optional[torch.Tensor] = None,  # [T, H * D] q's dtype (a plan's static buffer)
                    lse: Optional[torch.Tensor] = None,  # [H, T] float32
                    bm: int = 0, block_n: int = 0, tree_n: int = 0, num_warps: int = 0, num_stages: int = 0,
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """-> attention of q over the cache's committed keys of layer `layer` plus the n tree keys, as
    [T, H * D] (q's dtype), and the merged lse [H, T] (float32) if need_lse: tree_combine's
    contract. Launch parameters left 0 come from config()."""
    from specextend.attention._triton_kernels import INTERPRETED
    from specextend.attention._triton_short import short_attention as kernel

    h, t, d = q.shape
    g, n, _ = k.shape
    r = h // g
    assert q.is_contiguous() and bias.is_contiguous() and bias.shape == (r * t, n)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.dtype == v.dtype == q.dtype == anchor.dtype
    if out is None:
        out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)
    if need_lse and lse is None:
        lse = torch.empty(h, t, dtype=torch.float32, device=q.device)
    assert out.shape == (t, h * d) and out.dtype == q.dtype and out.is_contiguous()
    assert not need_lse or (lse.shape == (h, t) and lse.dtype == torch.float32 and lse.is_contiguous())
    ieee = q.dtype == torch.float32
    c = config(r * t, n, d, ieee)
    bm, block_n, tree_n = bm or c["bm"], block_n or c["block_n"], tree_n or c["tree_n"]
    if n == 0:  # no tree keys: nothing is read through these (a non-empty tensor for the launch)
        k = v = bias = q
    grid = (-(-r * t // bm), g)
    kernel[grid](q, anchor, meta, k, v, bias, out, lse if need_lse else out, scale * math.log2(math.e), layer,
                 k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 T=t, R=r, N=n, G=g, D=d, DP=_pow2(d), BLOCK_M=bm, BLOCK_N=block_n, TREE_N=tree_n,
                 NEED_LSE=need_lse, IEEE=ieee, INTERPRET=INTERPRETED,
                 num_warps=num_warps or c["num_warps"], num_stages=num_stages or c["num_stages"])
    return out, (lse if need_lse else None)


def short_reference(q: torch.Tensor,  # [H, T, D]
                    kc: torch.Tensor, vc: torch.Tensor,  # [G, >= L, D] the layer's cache
                    L: int,
                    k: torch.Tensor, v: torch.Tensor,  # [G, n, D] tree keys
                    bias: torch.Tensor,  # [(H/G) * T, n]
                    scale: float, need_lse: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The slow twin in plain torch: the prefix as one partial (partials_reference), merged with the
    tree part (tree_attention_merged) -> out [T, H * D] (q's dtype), lse [H, T] or None."""
    h, t, d = q.shape
    g = k.shape[0]
    # [G, 1, R*T, D], [G, 1, R*T]; no committed key (L = 0): out 0, lse -inf, a partial that weighs nothing
    out_p, lse_p = partials_reference(q.reshape(g, (h // g) * t, d), kc, vc, L, 1, scale)
    out, lse = tree_attention_merged(q, k, v, bias.to(compute_dtype(q.dtype)), out_p, lse_p, scale,
                                     need_lse=need_lse)  # [H, T, D]
    return out.transpose(0, 1).reshape(t, h * d), lse
