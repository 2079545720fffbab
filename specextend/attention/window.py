"""A prefill chunk's attention under a left window, in blocks of the window's length
(docs/architecture.md, "Attention backends", *Windowed prefill in blocks*).

Query p of a windowed chunk sees the keys (p - W, p]. As one call with an explicit [T, W - 1 + T]
mask (hybrid.layer_attention's composition, the twin here), every query is scored against every key
of the chunk and its window: 2,559 keys a query for the draft's 2,048-row chunks under a 512 window,
of which it sees 512. PyTorch's fused kernels skip nothing a mask hides. Cut into blocks of W
queries, block j's queries see only the keys of block j and of the block before it: one batched
call over [blocks, H, W, D] queries and [blocks, H, 2W, D] keys (overlapping windows of the keys,
copied once with the GQA repeat the masked call makes anyway) scores 2W keys a query, 2.5x fewer
for those chunks. The mask is one band [W, 2W] for every block, less the keys before position 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def blocks_pay(rows: int, window: int) -> bool:
    """Whether blocks score fewer query-key pairs than one masked call over the chunk and its window."""
    if window <= 0 or rows <= window:
        return False
    blocks = -(-rows // window)
    return blocks * window * 2 * window < rows * (window - 1 + rows)


def window_blocks(
    q: torch.Tensor,  # [H, T, D] queries at positions L .. L+T-1
    k: torch.Tensor,  # [G, >= L+T, D] the cache view, the chunk's keys staged at [L, L+T)
    v: torch.Tensor,  # [G, >= L+T, D]
    prefix_len: int,  # L
    window: int,  # W > 0: query p sees keys (p - W, p]
    scale: float,
) -> torch.Tensor:
    """-> out [H, T, D], as the masked call over keys (L - W, L + T) gives it (no LSE)."""
    h, t, d = q.shape
    g = k.shape[0]
    w, L = window, prefix_len
    nb = -(-t // w)  # blocks of queries, the last padded
    lo, hi = L - w, L + nb * w  # block j's keys: positions [L + (j - 1) W, L + (j + 1) W)
    a, b = max(lo, 0), L + t  # the keys that exist; zeros stand in for the others (masked or unread)
    pad = (0, 0, a - lo, hi - b)
    kb = F.pad(k[:, a:b], pad).unfold(1, 2 * w, w).permute(1, 0, 3, 2)  # [nb, G, 2W, D] (windows: a view of the pad's copy)
    vb = F.pad(v[:, a:b], pad).unfold(1, 2 * w, w).permute(1, 0, 3, 2)  # [nb, G, 2W, D]
    if g != h:  # (SDPA's fused kernels take a mask with as many K/V heads as query heads: backends.py)
        kb, vb = kb.repeat_interleave(h // g, dim=1), vb.repeat_interleave(h // g, dim=1)  # [nb, H, 2W, D]
    qb = F.pad(q, (0, 0, 0, nb * w - t)).view(h, nb, w, d).transpose(0, 1)  # [nb, H, W, D]
    i = torch.arange(w, device=q.device)[:, None]  # [W, 1] a query's row in its block
    m = torch.arange(2 * w, device=q.device)[None, :]  # [1, 2W] a key's column: position L + (j - 1) W + m
    band = (m > i) & (m <= i + w)  # [W, 2W] key position in (p - W, p], p = L + j W + i
    first = L + (torch.arange(nb, device=q.device) - 1) * w  # [nb] block j's first key position
    mask = band & (first[:, None, None] + m >= 0)  # [nb, W, 2W] (each row sees its own key: none empty)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None], scale=scale)  # [nb, H, W, D]
    return out.transpose(0, 1).reshape(h, nb * w, d)[:, :t]
