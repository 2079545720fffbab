"""Reference attention in plain math: the slow twin every fast kernel is tested against.

GQA without repeating K/V: the H query heads are viewed as [G, H/G] so each group multiplies its
own K/V. Softmax in float32 (float64 stays float64). Returns the output and the log-sum-exp of
each query row, which is what the LSE merge of Hybrid Tree Attention needs.
"""

from __future__ import annotations

from typing import Optional

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_eager(
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [G, S, D]
    v: torch.Tensor,  # [G, S, D]
    mask: Optional[torch.Tensor],  # [T, S] bool (True = may attend) or None
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [H, T, D] (q's dtype) and lse [H, T] (float32 or float64)."""
    h, t, d = q.shape
    g, s, _ = k.shape
    cd = compute_dtype(q.dtype)
    qg = q.reshape(g, h // g, t, d).to(cd)  # [G, H/G, T, D]
    scores = torch.einsum("grtd,gsd->grts", qg, k.to(cd)) * scale  # [G, H/G, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [G, H/G, T]
    # rows with no visible key (never produced by the engine) give lse=-inf; keep them finite
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(cd).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("grts,gsd->grtd", probs, v.to(cd))  # [G, H/G, T, D]
    return out.reshape(h, t, d).to(q.dtype), lse.reshape(h, t)


def merge_attention(
    out_a: torch.Tensor,  # [H, T, D]
    lse_a: torch.Tensor,  # [H, T]
    out_b: torch.Tensor,  # [H, T, D]
    lse_b: torch.Tensor,  # [H, T]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over two disjoint key sets: w = sigmoid(lse_a - lse_b)."""
    cd = compute_dtype(out_a.dtype)
    lse_a = lse_a.to(cd)
    lse_b = lse_b.to(cd)
    w = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)  # [H, T, 1]
    out = w * out_a.to(cd) + (1 - w) * out_b.to(cd)
    return out.to(out_a.dtype), torch.logaddexp(lse_a, lse_b)
