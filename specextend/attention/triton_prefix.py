"""Split-KV prefix attention in Triton that finds its KV cache through device memory.

For HTA's prefix part (queries of a few new tokens over a long committed prefix, no mask). Unlike
the fused SDPA kernels it takes no host-side length or address: `meta` [4] int64 on the device
holds (cache.data.data_ptr(), L, capacity, 0), so a CUDA graph that captured the launch serves any
session and any L (the full-step graphs, full_graphs.py). The grid is static: S splits of the
prefix per (row block, KV head); each writes a partial (out, lse) normalized over its own keys,
and the tree merge folds the S partials into its softmax exactly (tree_merge.py).

GQA without repeating K/V: the H/G query heads of a group are folded into rows (q [G, R*T, D]),
so one program reads each key block once for all of them.

The slow twin is `partials_reference` (plain torch, any device); tests compare them, on the CPU
through Triton's interpreter (TRITON_INTERPRET=1) where Triton is installed.
"""

from __future__ import annotations

import math
import os

import torch


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True




def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def block_m(rows: int) -> int:
    return min(64, max(16, 1 << (rows - 1).bit_length()))


def num_splits(rows: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per (row block, KV head) so that about two programs run per multiprocessor."""
    blocks = -(-rows // block_m(rows)) * num_kv_heads
    return max(1, min(64, round(2 * num_sms / blocks)))


def prefix_partials(q: torch.Tensor,  # [G, M, D] contiguous (M = (H/G) * T folded rows)
                    meta: torch.Tensor,  # [4] int64 on q's device: cache.data address, L, capacity, 0
                    layer: int, kv_dtype: torch.dtype, scale: float,
                    out: torch.Tensor,  # [G, S, M, D] float32
                    lse: torch.Tensor,  # [G, S, M] float32
                    block_n: int = 64) -> None:
    """Writes each split's attention of q over keys [s*chunk, min(L, (s+1)*chunk)) of the cache's
    layer `layer` into out / lse (empty splits: out 0, lse -inf)."""
    g, m, d = q.shape
    splits = out.shape[1]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    bm = block_m(m)
    grid = (-(-m // bm), splits, g)
    from specextend.attention._triton_kernels import prefix_partials as kernel

    kernel[grid](q, meta, out, lse, scale * math.log2(math.e), layer, m, G=g, D=d,
                 DP=1 << (d - 1).bit_length(), SPLITS=splits,
                             BLOCK_M=bm, BLOCK_N=block_n, KV_DTYPE=_tl_dtype(kv_dtype),
                             IEEE=q.dtype == torch.float32, INTERPRET=interpret,
                             num_warps=4, num_stages=2)


def partials_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, L: int, splits: int, scale: float,
                       block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same partials in plain torch: q [G, M, D], k, v [G, >= L, D] -> out [G, S, M, D], lse [G, S, M]
    (float32; float64 stays float64)."""
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    g, m, d = q.shape
    chunk = -(-(-(-L // splits)) // block_n) * block_n
    out = torch.zeros(g, splits, m, d, dtype=cd, device=q.device)
    lse = torch.full((g, splits, m), float("-inf"), dtype=cd, device=q.device)
    for s in range(splits):
        lo, hi = s * chunk, min(L, (s + 1) * chunk)
        if lo >= hi:
            continue
        sc = torch.einsum("gmd,gnd->gmn", q.to(cd), k[:, lo:hi].to(cd)) * scale  # [G, M, n]
        lse[:, s] = torch.logsumexp(sc, dim=-1)
        out[:, s] = torch.einsum("gmn,gnd->gmd", torch.softmax(sc, dim=-1), v[:, lo:hi].to(cd))
    return out, lse
