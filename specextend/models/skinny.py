"""Linear layers of a few rows in one kernel each, with their neighbours fused in (docs/architecture.md,
"Kernels"): a decode-time forward of a small model (the draft's tree levels, 4-16 rows; an AR step,
1 row) is bound by its count of small kernels, not by its weights (H100, 2026-11-23: the 0.5B
draft's level took ~11 graph nodes a layer, each a device launch gap and ~1.4-2.7 us of host
launch cost, for ~30 MB of weights, 10 us at the copy bandwidth).

    norm_linear        RMSNorm + x @ W.T (+ bias)           the QKV projection: 3 kernels -> 1
    norm_glu           RMSNorm + silu(x @ G.T) * (x @ U.T)   the MLP's first half: 3 -> 1
    linear_residual_   x += a @ W.T, in place                o-proj and down-proj: 1-2 -> 1

The norm's statistics come from the x tiles the dot reads anyway, and its scale is applied to the
accumulator (rstd * ((x * w_norm) @ W.T)), so no normalized copy of x is written. Rows are padded
to 16 for the tensor cores; the weights are read once, by cdiv(N, BN) programs.

Slow twin: `reference` (the torch ops the plain forward runs); tests compare them, on the CPU
through Triton's interpreter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

MAX_ROWS = 64  # more rows: the ordinary GEMMs (tiles of 16 rows stop paying)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (n - 1).bit_length())


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_ROWS and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16,
                                                                          torch.float32)


def config(t: int, n: int, k: int, num_sms: int = 132, ieee: bool = False) -> dict:
    """Tiles: all rows in one block; 128 weight columns of K an iteration (3 stages in flight);
    output blocks of 64, 32 or 16 columns, the widest that still gives every multiprocessor a
    program (narrow outputs such as the o- and down-projections of a 0.5B model get 56). float32
    (IEEE dots on CUDA cores) takes half the tiles: the gate/up pair spilled at 32+ rows (sm_90,
    benchmarks/triton_aot.py)."""
    bn = next((b for b in (64, 32) if -(-n // b) >= num_sms), 16)
    if ieee:
        return dict(BT=_pow2(t), BN=16 if t > 32 else min(bn, 32), BK=min(64, _pow2(k)), num_warps=4, num_stages=2)
    return dict(BT=_pow2(t), BN=bn, BK=min(128, _pow2(k)), num_warps=4, num_stages=3)


def _launch(x, nw, w, b, y, eps, n, glu, residual):
    from specextend.models._triton_skinny import skinny_linear as kernel

    t, k = x.shape
    assert x.is_contiguous() and w.is_contiguous() and y.is_contiguous() and t <= MAX_ROWS
    c = config(t, n, k, ieee=x.dtype == torch.float32)
    dummy = w  # an unused pointer argument
    kernel[(-(-n // c["BN"]),)](x, nw if nw is not None else dummy, w, b if b is not None else dummy, y,
                                float(eps), t, K=k, N=n, NORM=nw is not None, BIAS=b is not None, GLU=glu,
                                RESIDUAL=residual, IEEE=x.dtype == torch.float32, BT=c["BT"], BN=c["BN"],
                                BK=c["BK"], num_warps=c["num_warps"], num_stages=c["num_stages"])
    return y


def norm_linear(x: torch.Tensor,  # [T, K]
                nw: Optional[torch.Tensor], eps: float,  # [K] RMSNorm weight (None: no norm)
                w: torch.Tensor,  # [N, K]
                b: Optional[torch.Tensor] = None) -> torch.Tensor:  # [N]
    """-> rms_norm(x) @ w.T + b [T, N]."""
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, nw, w, b, y, eps, w.shape[0], False, False)


def norm_glu(x: torch.Tensor, nw: torch.Tensor, eps: float,
             w: torch.Tensor) -> torch.Tensor:  # [2I, K]: gate rows, then up rows
    """-> silu(rms_norm(x) @ gate.T) * (rms_norm(x) @ up.T) [T, I]."""
    i = w.shape[0] // 2
    y = torch.empty(x.shape[0], i, dtype=x.dtype, device=x.device)
    return _launch(x, nw, w, None, y, eps, i, True, False)


def linear_residual_(x: torch.Tensor,  # [T, N], updated in place
                     a: torch.Tensor,  # [T, K]
                     w: torch.Tensor) -> torch.Tensor:  # [N, K]
    """x += a @ w.T; returns x."""
    return _launch(a, None, w, None, x, 0.0, w.shape[0], False, True)


def reference(x, nw, eps, w, b=None, glu: bool = False, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The slow twin of all three: the torch ops of decoder.layer_pre / layer_post."""
    h = F.rms_norm(x, (x.shape[-1],), nw, eps) if nw is not None else x
    if glu:
        gate, up = F.linear(h, w).chunk(2, dim=-1)
        return F.silu(gate) * up
    y = F.linear(h, w, b)
    return y if residual is None else residual + y
