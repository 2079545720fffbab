"""The tree part of Hybrid Tree Attention fused with the LSE merge (the fast path of
attention_eager + merge_attention, which stay as its slow twin).

The prefix part arrives as (out_p, lse_p). Appending lse_p as one more score column makes a single
softmax over [tree scores, lse_p] exact for the union of both key sets:
    p = softmax([s_1..s_n, lse_p]),  out = sum_j p_j v_j + p_{n+1} out_p,  lse = logsumexp(...).
About ten kernels instead of some thirty; GQA without repeating K/V (query heads of a group are
folded into rows).
"""

from __future__ import annotations

from typing import Optional

import torch

from specextend.attention.eager import compute_dtype


def mask_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, n] bool (True = may attend) -> additive bias [(H/G) * T, n] (0 or -inf), rows as folded."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(group, 1)


def tree_attention_merged(
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [G, n, D] tree keys (RoPE applied)
    v: torch.Tensor,  # [G, n, D]
    bias: torch.Tensor,  # [(H/G) * T, n] from mask_bias, in the compute dtype
    out_p: torch.Tensor,  # [H, T, D] prefix attention, or [G, S, (H/G) * T, D] S partials of it
    lse_p: torch.Tensor,  # [H, T] prefix log-sum-exp, or [G, S, (H/G) * T] (at least one finite)
    scale: float,
    need_lse: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns out [H, T, D] over prefix + tree keys and, if need_lse, the merged lse [H, T].

    The prefix part may come as S partials over disjoint key ranges (the split-KV kernel of
    triton_prefix.py): each is one more score column, so the one softmax stays exact."""
    h, t, d = q.shape
    g, n, _ = k.shape
    cd = compute_dtype(q.dtype)
    rows = (h // g) * t
    qg = q.reshape(g, rows, d).to(cd)  # [G, R*T, D]
    s = torch.baddbmm(bias, qg, k.to(cd).transpose(1, 2), alpha=scale)  # [G, R*T, n]
    if out_p.dim() == 3:  # one prefix part [H, T, D], [H, T]
        s = torch.cat([s, lse_p.reshape(g, rows, 1).to(cd)], dim=-1)  # [G, R*T, n + 1]
        p = torch.softmax(s, dim=-1)  # [G, R*T, n + 1]
        prefix = p[..., n:] * out_p.reshape(g, rows, d).to(cd)  # [G, R*T, D]
    else:  # S partials [G, S, R*T, D], [G, S, R*T]
        s = torch.cat([s, lse_p.transpose(1, 2).to(cd)], dim=-1)  # [G, R*T, n + S]
        p = torch.softmax(s, dim=-1)  # [G, R*T, n + S]
        prefix = (p[..., n:].transpose(1, 2)[..., None] * out_p.to(cd)).sum(1)  # [G, R*T, D]
    out = torch.baddbmm(prefix, p[..., :n], v.to(cd))  # [G, R*T, D]
    lse = torch.logsumexp(s, dim=-1).reshape(h, t) if need_lse else None
    return out.reshape(h, t, d).to(q.dtype), lse
