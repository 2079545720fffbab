"""Triton kernel of skinny.py (imported lazily: Triton is optional; with TRITON_INTERPRET=1 set
before Triton is first imported it runs in Triton's CPU interpreter)."""

import triton
import triton.language as tl


@triton.jit
def skinny_linear(x_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, eps, T,
                  K: tl.constexpr, N: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                  GLU: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                  BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One program: output columns [pid * BN, +BN) of all T (<= BT) rows.

        y = epilogue(rstd * ((x * nw) @ w[:N].T))       rstd = rsqrt(mean(x^2) + eps) if NORM, else 1
        epilogue: + b (BIAS); silu(.) * (rstd * (x * nw) @ w[N:2N].T) (GLU: w holds gate | up);
                  + y, in place (RESIDUAL)

    x [T, K], w [N or 2N, K], y [T, N], all contiguous. The weights are read once, BK columns an
    iteration (the loop that the compiler pipelines); x is re-read by every program (T * K values,
    from L2). float32 accumulation; the norm's statistics come from the same x tiles as the dot."""
    pid = tl.program_id(0)
    offs_t = tl.arange(0, BT)  # [BT]
    offs_n = pid * BN + tl.arange(0, BN)  # [BN]
    t_ok = offs_t < T
    n_ok = offs_n < N
    acc = tl.zeros([BT, BN], tl.float32)
    acc2 = tl.zeros([BT, BN], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)  # [BK]
        k_ok = offs_k < K
        xk = tl.load(x_ptr + offs_t[:, None] * K + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                     other=0.0)  # [BT, BK]
        if NORM:
            xf = xk.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
            xk = (xf * tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(xk.dtype)
        wk = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                     other=0.0)  # [BN, BK]
        if IEEE:
            acc += tl.dot(xk, tl.trans(wk), input_precision="ieee")
        else:
            acc += tl.dot(xk, tl.trans(wk))
        if GLU:
            uk = tl.load(w_ptr + (N + offs_n)[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                         other=0.0)  # [BN, BK] the up projection's rows
            if IEEE:
                acc2 += tl.dot(xk, tl.trans(uk), input_precision="ieee")
            else:
                acc2 += tl.dot(xk, tl.trans(uk))
    if NORM:
        rstd = 1.0 / tl.sqrt(ss / K + eps)  # [BT]
        acc = acc * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    if BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    io = t_ok[:, None] & n_ok[None, :]  # [BT, BN]
    dst = y_ptr + offs_t[:, None] * N + offs_n[None, :]
    if RESIDUAL:
        acc += tl.load(dst, mask=io, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=io)
