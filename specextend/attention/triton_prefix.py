"""Split-KV prefix attention in Triton that finds its KV cache through device memory.

For HTA's prefix part (queries of a few new tokens over a long committed prefix, no mask). Unlike
the fused SDPA kernels it takes no host-side length or address: `meta` [4] int64 on the device
holds (the cache's element offset from a fixed anchor tensor, L, capacity, 0), so a CUDA graph that captured the launch serves any
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

import torch

from specextend import pdl
from specextend.pdl import launch_args


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True




TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the Triton kernels take
ALIGN = 16  # elements: the kernel assumes the cache offset from its anchor is a multiple of this


def cache_meta(data: torch.Tensor, anchor: torch.Tensor, length: int) -> list[int]:
    """meta for prefix_partials: data (KVCache.data [layers, 2, G, capacity, D]) as an element offset
    from `anchor` (any tensor of the cache's dtype and device that outlives the graphs), its
    committed length and capacity. Offsets are whole elements, multiples of ALIGN."""
    if data.dtype != anchor.dtype or data.device != anchor.device or not data.is_contiguous():
        raise ValueError("the KV cache must be contiguous, of the anchor's dtype and device")
    delta = data.data_ptr() - anchor.data_ptr()
    if delta % (ALIGN * data.element_size()):
        raise ValueError(f"KV cache address not {ALIGN}-element aligned with its anchor")
    return [delta // data.element_size(), length, data.shape[3], 0]


# Key block of the prefix kernel for 17-64 folded rows, by head dim (H200, 2026-11-30;
# benchmarks/README.md, "Kernels"): 128 keys sped the kernel alone but not the 1.5B's whole 4-node
# verify (head dim 128: 2.06 ms of kernels either way, its wall time 0.17 ms longer), so head dims
# over 64 keep 64; the 0.5B draft's head dim of 64 (half the shared memory a block) takes 128, its
# step 5.97-5.98 against 6.10-6.11 ms of kernels.
MID_BLOCK_N = 64
NARROW_BLOCK_N = 128


def config(rows: int, ieee: bool = False, d: int = 128) -> dict:
    """Block sizes and launch parameters by folded query rows, from benchmarks/prefix_kernel.py on
    an H100 (2026-11-23, 16K keys, D=128, bf16, each configuration timed with the combine kernel
    that reads its partials; benchmarks/ at commit 77940b1): 4 rows (AR) 31.6 us, 68 (a
    16-node tree) 36.1, 204 (a 50-node tree) 57.9, against a 22.5 us floor and FlashAttention-2's
    37.4 / 43.4 / 72.8 through torch. float32 caches (`ieee`: IEEE float32 dots on CUDA cores)
    take small tiles that compile for sm_90 without spilling (benchmarks/triton_aot.py; not timed).
    d: the head dim (17-64 rows take MID_BLOCK_N or NARROW_BLOCK_N keys at a time by it)."""
    if ieee:
        return dict(bm=16 if rows <= 16 else 32, block_n=32, num_warps=8, num_stages=2)
    if rows <= 16:  # an AR step: key blocks of 128 (H200, 2026-11-28, below MAX_SPLITS: 9.05 against 10.36 us)
        return dict(bm=16, block_n=128, num_warps=4, num_stages=3)
    if rows <= 64:  # a lookup's few tokens, the draft's levels: key blocks by head dim d (above)
        bn = NARROW_BLOCK_N if d <= 64 else MID_BLOCK_N
        return dict(bm=max(16, 1 << (rows - 1).bit_length()), block_n=bn, num_warps=4, num_stages=3)
    if rows <= 128:
        return dict(bm=128, block_n=64, num_warps=8, num_stages=4)
    return dict(bm=128, block_n=128, num_warps=8, num_stages=3)


MIN_CHUNK = 128  # keys: a short cache fills few splits (the combine reads only those)
# At most this many splits per (row block, KV head), so that two KV heads (the Qwen pair) still
# fill the machine. It was 32 while the merge (fused_layer.tree_combine) read the partials in rounds
# of 8, a memory round trip each (2026-11-28); since the merge reads more than 16 splits in one load,
# 64 splits are faster: H200, 2026-11-30, the 1.5B's attention a layer at 16K 13.2-13.5 against
# 14.6-14.8 us (AR), 15.1 against 20.5-20.7 (4 tokens), at 30K 16.2 against 19.5; whole steps
# (docs/architecture.md, "Kernels") 2-10% less device time, the draft's unchanged.
MAX_SPLITS = 64


def split_chunk(L: int, splits: int, block_n: int, min_chunk: int = MIN_CHUNK) -> int:
    """Keys per split: L spread over the splits in whole key blocks, at least min_chunk (a multiple
    of block_n) so that a cache of a few thousand keys, like the draft's retrieval working cache,
    fills a few splits whose partials the combine reads, not ~64 nearly empty ones."""
    return max(-(-(-(-L // splits)) // block_n) * block_n, -(-min_chunk // block_n) * block_n)


def block_m(rows: int, ieee: bool = False) -> int:
    return config(rows, ieee)["bm"]


def num_splits(rows: int, num_kv_heads: int, num_sms: int, ieee: bool = False, sessions: int = 1) -> int:
    """Splits per (row block, KV head, session) so that about one program runs per multiprocessor
    (the sweep above: half as many splits as two per multiprocessor won at 4, 68 and 204 rows), at
    most MAX_SPLITS; `rows`: one session's folded rows."""
    blocks = -(-rows // block_m(rows, ieee)) * num_kv_heads * sessions
    return max(1, min(MAX_SPLITS, round(num_sms / blocks)))


def prefix_partials(q: torch.Tensor,  # [G, M, D] contiguous (M = (H/G) * B * T folded rows)
                    anchor: torch.Tensor,  # the cache's dtype: meta[0] counts elements from here
                    meta: torch.Tensor,  # [4 * B] int64 on q's device, from cache_meta per session
                    layer: int, scale: float,
                    out: torch.Tensor,  # [G, S, M, D] float32
                    lse: torch.Tensor,  # [G, S, M] float32
                    block_n: int = 0, num_warps: int = 0, num_stages: int = 0, bm: int = 0,
                    min_chunk: int = MIN_CHUNK, sessions: int = 1, tokens: int = 0) -> None:
    """Writes each split's attention of q over keys [s*chunk, min(L, (s+1)*chunk)) of the cache's
    layer `layer` into out / lse (chunk = split_chunk(L, S, block_n, min_chunk); empty splits: out
    0, lse -inf). Launch parameters left 0 come from config(M / B, float32).

    With B `sessions`, q holds B sessions' T tokens each, folded as (query head of the group,
    session, token): the rows of `q.view(G, H/G, B, T, D)` (T = `tokens`), which is q [H, B * T, D] of a batched
    forward viewed as [G, (H/G) * B * T, D]. Session b's rows attend over the cache of meta[4b:4b + 4]
    (docs/architecture.md, "Batched steps")."""
    g, m, d = q.shape
    splits = out.shape[1]
    if m % sessions or meta.numel() < 4 * sessions:
        raise ValueError(f"{m} folded rows and {meta.numel()} meta entries do not make {sessions} sessions")
    per = m // sessions  # folded rows of one session
    tokens = tokens or per  # with one session any T maps its rows to themselves
    if per % tokens:
        raise ValueError(f"{per} folded rows a session is not a whole number of query heads of {tokens} tokens")
    c = config(per, q.dtype == torch.float32, d)
    bm, block_n = bm or c["bm"], block_n or c["block_n"]
    num_warps, num_stages = num_warps or c["num_warps"], num_stages or c["num_stages"]
    grid = (-(-per // bm), splits, g * sessions)
    from specextend.attention._triton_kernels import INTERPRETED
    from specextend.attention._triton_kernels import prefix_partials as kernel

    on = pdl.enabled(q.device)

    kernel[grid](q, anchor, meta, out, lse, scale * math.log2(math.e), layer, m, tokens, sessions, G=g, D=d,
                 DP=1 << (d - 1).bit_length(), SPLITS=splits, BLOCK_M=bm, BLOCK_N=block_n,
                 MIN_CHUNK=-(-min_chunk // block_n) * block_n,
                 IEEE=q.dtype == torch.float32, INTERPRET=INTERPRETED, PDL=on,
                 num_warps=num_warps, num_stages=num_stages, **launch_args(on))


def partials_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, L: int, splits: int, scale: float,
                       block_n: int = 64, min_chunk: int = MIN_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same partials in plain torch: q [G, M, D], k, v [G, >= L, D] -> out [G, S, M, D], lse [G, S, M]
    (float32; float64 stays float64)."""
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    g, m, d = q.shape
    chunk = split_chunk(L, splits, block_n, min_chunk)
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
