"""One layer's attention of T new queries over a cache prefix of L keys plus the T new keys.

Two compositions (both exact):
  hybrid  (Hybrid Tree Attention, docs/architecture.md, "Hybrid Tree Attention") prefix part with no mask through the backend's
          LSE-returning kernel, new part with its mask (causal block through the kernel, tree
          mask in explicit float32 math), merged by log-sum-exp;
  plain   one masked attention over the L + T keys (the standard verification baseline).
`window` > 0 restricts every query to the last `window` positions (draft prefill).
A backend that runs a causal block ending the keys in one kernel (flash, for prefill chunks) takes
the causal cases whole; the compositions below are its twin.
"""

from __future__ import annotations

from typing import Optional

import torch

from specextend.attention.backends import CAUSAL, AttentionBackend, EagerBackend, Mask, causal_mask
from specextend.attention.eager import attention_eager, compute_dtype, merge_attention
from specextend.attention.tree_merge import mask_bias, tree_attention_merged
from specextend.attention.window import window_blocks


def layer_attention(
    backend: AttentionBackend,
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [G, >= L+T, D] cache view, new keys already staged at [L, L+T)
    v: torch.Tensor,  # [G, >= L+T, D]
    prefix_len: int,  # L
    new_mask: Mask,  # CAUSAL, or [T, T'] bool over the T' >= T staged keys (the last T are the queries')
    scale: float,
    hybrid: bool = True,
    need_lse: bool = False,
    window: int = 0,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns out [H, T, D] and, if need_lse, the merged lse [H, T]."""
    t = q.shape[1]
    L = prefix_len
    if new_mask == CAUSAL and backend.takes_end_causal(q, k):  # one kernel; the paths below are its twin
        lo = max(0, L - window + 1) if window > 0 else 0
        return backend.attend_end_causal(q, k[:, lo:L + t], v[:, lo:L + t], scale, need_lse, window)
    if window > 0 and new_mask == CAUSAL:
        if not need_lse and backend.takes_window_blocks(t, window, q.device):  # the masked call below is its twin
            return window_blocks(q, k, v, L, window, scale), None
        lo = max(0, L - window + 1)
        pos_q = torch.arange(L, L + t, device=q.device)[:, None]  # [T, 1]
        pos_k = torch.arange(lo, L + t, device=q.device)[None, :]  # [1, S]
        mask = (pos_k <= pos_q) & (pos_k > pos_q - window)  # [T, S]
        return backend.attend(q, k[:, lo:L + t], v[:, lo:L + t], mask, scale, need_lse)
    if new_mask == CAUSAL:
        if t == 1:  # decode: one query sees everything
            return backend.attend(q, k[:, :L + 1], v[:, :L + 1], None, scale, need_lse)
        if L == 0:
            return backend.attend(q, k[:, :t], v[:, :t], CAUSAL, scale, need_lse)
        if not hybrid:
            mask = causal_mask(t, L + t, q.device)
            return backend.attend(q, k[:, :L + t], v[:, :L + t], mask, scale, need_lse)
        out_p, lse_p = backend.attend(q, k[:, :L], v[:, :L], None, scale, True)
        out_n, lse_n = backend.attend(q, k[:, L:L + t], v[:, L:L + t], CAUSAL, scale, True)
        return merge_attention(out_p, lse_p, out_n, lse_n)
    # tree mask over the staged keys
    n = new_mask.shape[1]  # T'
    if not hybrid or L == 0:
        full = torch.cat([torch.ones(t, L, dtype=torch.bool, device=q.device), new_mask], dim=1)  # [T, L+T']
        return backend.attend(q, k[:, :L + n], v[:, :L + n], full, scale, need_lse)
    out_p, lse_p = backend.attend(q, k[:, :L], v[:, :L], None, scale, True)
    if isinstance(backend, EagerBackend):  # the reference composition
        out_t, lse_t = attention_eager(q, k[:, L:L + n], v[:, L:L + n], new_mask, scale)
        return merge_attention(out_p, lse_p, out_t, lse_t)
    bias = mask_bias(new_mask, q.shape[0] // k.shape[0], compute_dtype(q.dtype))
    return tree_attention_merged(q, k[:, L:L + n], v[:, L:L + n], bias, out_p, lse_p, scale, need_lse)
