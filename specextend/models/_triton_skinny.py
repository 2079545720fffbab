"""Triton kernel of skinny.py (imported lazily: Triton is optional; with TRITON_INTERPRET=1 set
before Triton is first imported it runs in Triton's CPU interpreter)."""

import triton
import triton.language as tl


@triton.jit
def skinny_linear(x_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, eps, T,
                  K: tl.constexpr, N: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                  GLU: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                  BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  SPLIT: tl.constexpr, KS: tl.constexpr):
    """Program (pid, pk): output columns [pid * BN, +BN) of all T (<= BT) rows, over the K columns
    [pk * KS, +KS) (KS = K rounded up to BK when SPLIT == 1).

        y = epilogue(rstd * ((x * nw) @ w[:N].T))       rstd = rsqrt(mean(x^2) + eps) if NORM, else 1
        epilogue: + b (BIAS); silu(.) * (rstd * (x * nw) @ w[N:2N].T) (GLU: w holds gate | up);
                  + y, in place (RESIDUAL)

    x [T, K], w [N or 2N, K], y [T, N], all contiguous. The weights are read once, BK columns an
    iteration (the loop that the compiler pipelines); x is re-read by every program (T * K values,
    from L2). float32 accumulation; the norm's statistics come from the same x tiles as the dot.

    Split-K (SPLIT > 1; without NORM or GLU, whose epilogues need all of K): a narrow output over a
    long K (the down projection: 56 column blocks, 38 iterations each) would leave most
    multiprocessors idle, so SPLIT programs share a column block. Each writes its float32 partial
    to ws [SPLIT, BT, N] and counts itself in cnt[pid] (int32, zero before the launch); the last
    to arrive sums the SPLIT partials in the fixed order 0..SPLIT-1 (the result does not depend on
    which program finished last), applies the epilogue and zeroes its counter."""
    pid = tl.program_id(0)
    pk = tl.program_id(1)
    offs_t = tl.arange(0, BT)  # [BT]
    offs_n = pid * BN + tl.arange(0, BN)  # [BN]
    t_ok = offs_t < T
    n_ok = offs_n < N
    acc = tl.zeros([BT, BN], tl.float32)
    acc2 = tl.zeros([BT, BN], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for k0 in range(0, KS, BK):  # KS = K (rounded up to BK) when SPLIT == 1; constant bounds (pipelined)
        offs_k = pk * KS + k0 + tl.arange(0, BK)  # [BK]
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
    io = t_ok[:, None] & n_ok[None, :]  # [BT, BN]
    dst = y_ptr + offs_t[:, None] * N + offs_n[None, :]
    if SPLIT == 1:
        _epilogue(acc, acc2, ss, b_ptr, dst, offs_n, n_ok, io, eps, K, NORM, BIAS, GLU, RESIDUAL, y_ptr)
    else:
        part = ws_ptr + offs_t[:, None] * N + offs_n[None, :]  # [BT, BN] of partial 0
        tl.store(part + pk * BT * N, acc, mask=io)
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")  # releases the partial, acquires the others'
        if arrived == SPLIT - 1:
            total = tl.zeros([BT, BN], tl.float32)
            for s in range(SPLIT):
                total += tl.load(part + s * BT * N, mask=io, other=0.0, cache_modifier=".cg")
            _epilogue(total, acc2, ss, b_ptr, dst, offs_n, n_ok, io, eps, K, NORM, BIAS, GLU, RESIDUAL, y_ptr)
            tl.atomic_xchg(cnt_ptr + pid, 0)  # ready for the next launch (and the next graph replay)


@triton.jit
def _epilogue(acc, acc2, ss, b_ptr, dst, offs_n, n_ok, io, eps, K: tl.constexpr, NORM: tl.constexpr,
              BIAS: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr, y_ptr):
    if NORM:
        rstd = 1.0 / tl.sqrt(ss / K + eps)  # [BT]
        acc = acc * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    if BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    if RESIDUAL:
        acc += tl.load(dst, mask=io, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=io)
