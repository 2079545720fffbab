"""Triton kernel of skinny.py (imported lazily: Triton is optional; with TRITON_INTERPRET=1 set
before Triton is first imported it runs in Triton's CPU interpreter)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def skinny_linear(x_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, eps, T,
                  K: tl.constexpr, N: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                  GLU: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                  BT: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr, KSP: tl.constexpr,
                  SPLIT: tl.constexpr, BKX: tl.constexpr, PDL: tl.constexpr,
                  LATE: tl.constexpr = False):
    """Program (pid, pk): output columns [pid * BN, +BN) of all T (<= BT) rows, over the K columns
    [pk * KS, +KS) (KSP: KS rounded up to a power of two; SPLIT * KS >= K).

        y = epilogue(rstd * ((x * nw) @ w[:N].T))       rstd = rsqrt(mean(x^2) + eps) if NORM, else 1
        epilogue: + b (BIAS); silu(.) * (rstd * (x * nw) @ w[N:2N].T) (GLU: w holds gate | up);
                  + y, in place (RESIDUAL)

    x [T, K], w [N or 2N, K], y [T, N], all contiguous. Each program loads its whole weight slice
    [BN, KS] (and the norm weight and bias) in one go, *before* it waits for the kernels before it
    (PDL: Programmatic Dependent Launch, sm_90+): the weights are never written while a forward
    runs, so their loads overlap the previous kernel's work, and a chain of these kernels streams
    weights at the memory's pace instead of paying a launch and a memory latency each. Everything
    the previous kernels write (x, y, the counters) is read only after gdc_wait. The program also
    lets the next kernel launch at once (gdc_launch_dependents): it can only start once every
    program of this one has.

    The norm's statistics are over all of K: each program reads all of x (T * K values, from L2),
    BKX columns at a time. float32 accumulation.

    Split-K (SPLIT > 1): each program writes its float32 partial(s) to ws [SPLIT, 2, BT, N] and counts
    itself in cnt[pid] (int32, zero before the launch); the last to arrive sums the SPLIT partials
    in the fixed order 0..SPLIT-1 (the result does not depend on which program finished last),
    applies the epilogue and zeroes its counter."""
    pid = tl.program_id(0)
    pk = tl.program_id(1)
    offs_t = tl.arange(0, BT)  # [BT]
    offs_n = pid * BN + tl.arange(0, BN)  # [BN]
    offs_k = pk * KS + tl.arange(0, KSP)  # [KSP]
    t_ok = offs_t < T
    n_ok = offs_n < N
    k_ok = (tl.arange(0, KSP) < KS) & (offs_k < K)
    wmask = n_ok[:, None] & k_ok[None, :]
    wk = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)  # [BN, KSP]
    if GLU:
        uk = tl.load(w_ptr + (N + offs_n)[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)  # [BN, KSP] up rows
    if NORM:
        nwk = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [KSP]
    bias = tl.zeros([BN], tl.float32)
    if BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
    if PDL:
        if not LATE:  # (LATE: once this program's main loop is done; docs/architecture.md, "Kernels")
            gdc_launch_dependents()
        gdc_wait()  # the kernels before this one are done: x and y may be read
    xk = tl.load(x_ptr + offs_t[:, None] * K + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                 other=0.0)  # [BT, KSP]
    if NORM:
        ss = _row_sumsq(x_ptr, offs_t, t_ok, K, BT, BKX)  # [BT]
        xk = (xk.to(tl.float32) * nwk[None, :]).to(xk.dtype)
    acc = _dot(xk, wk, IEEE)  # [BT, BN]
    acc2 = acc
    if GLU:
        acc2 = _dot(xk, uk, IEEE)
    if NORM:
        rstd = 1.0 / tl.sqrt(ss / K + eps)  # [BT] (linear: applied to each partial)
        acc = acc * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    if PDL and LATE:
        gdc_launch_dependents()
    _finish(acc, acc2, bias, y_ptr, ws_ptr, cnt_ptr, pid, pk, offs_t, offs_n, t_ok, n_ok, N, BT, BN, SPLIT, BIAS, GLU,
            RESIDUAL)


@triton.jit
def _row_sumsq(x_ptr, offs_t, t_ok, K: tl.constexpr, BT: tl.constexpr, BKX: tl.constexpr):
    """[BT] float32 sums of squares of x's rows [T, K] over all of K, BKX columns at a time (the
    norm's statistics of a program that does not read the whole row for its dot)."""
    ss = tl.zeros([BT], tl.float32)
    for k0 in range(0, K, BKX):
        offs_x = k0 + tl.arange(0, BKX)
        xx = tl.load(x_ptr + offs_t[:, None] * K + offs_x[None, :], mask=t_ok[:, None] & (offs_x < K)[None, :],
                     other=0.0).to(tl.float32)  # [BT, BKX]
        ss += tl.sum(xx * xx, 1)
    return ss


@triton.jit
def _finish(acc, acc2, bias, y_ptr, ws_ptr, cnt_ptr, pid, pk, offs_t, offs_n, t_ok, n_ok, N: tl.constexpr,
            BT: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, BIAS: tl.constexpr, GLU: tl.constexpr,
            RESIDUAL: tl.constexpr):
    """A program's accumulators [BT, BN] (float32) to y: the epilogue at once without a split; with
    one, the partial(s) to ws and the arrival counted, the last program of the column block
    summing them in split order."""
    io = t_ok[:, None] & n_ok[None, :]  # [BT, BN]
    dst = y_ptr + offs_t[:, None] * N + offs_n[None, :]
    if SPLIT == 1:
        _epilogue(acc, acc2, bias, dst, io, BIAS, GLU, RESIDUAL, y_ptr)
    else:
        part = ws_ptr + offs_t[:, None] * N + offs_n[None, :]  # [BT, BN] of partial 0 (gate)
        tl.store(part + pk * 2 * BT * N, acc, mask=io)
        if GLU:
            tl.store(part + (pk * 2 + 1) * BT * N, acc2, mask=io)
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")  # releases the partial, acquires the others'
        if arrived == SPLIT - 1:
            total = tl.zeros([BT, BN], tl.float32)
            total2 = tl.zeros([BT, BN], tl.float32)
            for s in range(SPLIT):
                total += tl.load(part + s * 2 * BT * N, mask=io, other=0.0, cache_modifier=".cg")
                if GLU:
                    total2 += tl.load(part + (s * 2 + 1) * BT * N, mask=io, other=0.0, cache_modifier=".cg")
            _epilogue(total, total2, bias, dst, io, BIAS, GLU, RESIDUAL, y_ptr)
            tl.atomic_xchg(cnt_ptr + pid, 0)  # ready for the next launch (and the next graph replay)


@triton.jit
def _dot(x, w, IEEE: tl.constexpr):
    """x [BT, BK] @ w [BN, BK].T -> [BT, BN] float32 (float32 inputs: IEEE dots, not TF32)."""
    if IEEE:
        out = tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        out = tl.dot(x, tl.trans(w))
    return out


@triton.jit
def _epilogue(acc, acc2, bias, dst, io, BIAS: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr, y_ptr):
    if BIAS:
        acc += bias[None, :]
    if GLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    if RESIDUAL:
        acc += tl.load(dst, mask=io, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=io)


@triton.jit
def skinny_loop(x_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, eps, T,
                K: tl.constexpr, N: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                GLU: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                BT: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr, BK: tl.constexpr,
                SPLIT: tl.constexpr, STAGES: tl.constexpr, BKX: tl.constexpr, PDL: tl.constexpr,
                LATE: tl.constexpr = False):
    """skinny_linear with the weight slice streamed: program (pid, pk) loops over its K columns
    [pk * KS, +KS) (KS a multiple of BK) BK at a time, the loads of the next STAGES - 1 steps in
    flight while one multiplies (software pipelining), so a program needs no register budget for
    its slice and K is split only to spread a narrow output over more multiprocessors (the
    whole-slice kernel above split the 0.5B draft's gate/up 14 ways to fit its registers, and
    paid the partials' round trip). The same maths, epilogue and split-K reduction as
    skinny_linear; without a split the norm's statistics come from the x tiles the loop reads."""
    pid = tl.program_id(0)
    pk = tl.program_id(1)
    offs_t = tl.arange(0, BT)  # [BT]
    offs_n = pid * BN + tl.arange(0, BN)  # [BN]
    t_ok = offs_t < T
    n_ok = offs_n < N
    bias = tl.zeros([BN], tl.float32)
    if BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
    if PDL:
        if not LATE:  # (LATE: once this program's main loop is done; docs/architecture.md, "Kernels")
            gdc_launch_dependents()
        gdc_wait()  # the kernels before this one are done: x and y may be read
    acc = tl.zeros([BT, BN], tl.float32)
    acc2 = tl.zeros([BT, BN], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for kk in tl.range(0, KS, BK, num_stages=STAGES):
        offs_k = pk * KS + kk + tl.arange(0, BK)  # [BK]
        k_ok = offs_k < K
        wmask = n_ok[:, None] & k_ok[None, :]
        wk = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)  # [BN, BK]
        xk = tl.load(x_ptr + offs_t[:, None] * K + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                     other=0.0)  # [BT, BK]
        if NORM:
            xf = xk.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
            nwk = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
            xk = (xf * nwk[None, :]).to(xk.dtype)
        acc += _dot(xk, wk, IEEE)  # [BT, BN]
        if GLU:
            uk = tl.load(w_ptr + (N + offs_n)[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)  # [BN, BK] up rows
            acc2 += _dot(xk, uk, IEEE)
    if NORM:
        if SPLIT > 1:  # this program saw only its K range: the whole row's sum of squares
            ss = _row_sumsq(x_ptr, offs_t, t_ok, K, BT, BKX)  # [BT]
        rstd = 1.0 / tl.sqrt(ss / K + eps)  # [BT]
        acc = acc * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    if PDL and LATE:
        gdc_launch_dependents()
    _finish(acc, acc2, bias, y_ptr, ws_ptr, cnt_ptr, pid, pk, offs_t, offs_n, t_ok, n_ok, N, BT, BN, SPLIT, BIAS, GLU,
            RESIDUAL)


@triton.jit
def skinny_tiles(x_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, eps, T, progs,
                 K: tl.constexpr, N: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                 GLU: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                 BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                 BKX: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr,
                 LATE: tl.constexpr = False):
    """skinny_linear's maths with a persistent grid: `progs` programs (fewer than the column blocks)
    each take the column blocks pid, pid + progs, ... and run *one* loop over all their (block,
    K chunk) units, BK columns of K a unit, with the weight loads of the next STAGES - 1 units in
    flight across block boundaries. Where K is short (the 0.5B draft's 896: 7 chunks of 128) a
    program per block, looping over its K alone, ends before its pipeline fills, and a second wave
    of programs pays the ramp again; here each program's weight stream runs unbroken from its first
    block to its last. No split-K: each block's sums stay in one program, in K order.

    The norm's statistics are computed once per program before the loop (x is T * K values, read
    from L2), and each x chunk is normalized as the RMSNorm kernel does, x * rstd * nw in float32
    rounded once to x's dtype, before its dot. A block's epilogue (bias, SiLU * up, residual) is
    stored masked to the unit that ends the block, and its sums reset, inside the loop: no branch,
    so the loop stays one software-pipelined body. Every program runs the same count of units
    (blocks past the last are masked out: no memory traffic)."""
    pid = tl.program_id(0)  # of `progs`, the grid
    KC: tl.constexpr = (K + BK - 1) // BK  # K chunks per column block
    units = (tl.cdiv(N, BN) + progs - 1) // progs * KC
    offs_t = tl.arange(0, BT)  # [BT]
    t_ok = offs_t < T
    if PDL:
        if not LATE:  # (LATE: once this program's main loop is done; docs/architecture.md, "Kernels")
            gdc_launch_dependents()
        gdc_wait()  # the kernels before this one are done: x and y may be read
    rstd = tl.full([BT], 1.0, tl.float32)
    if NORM:
        ss = _row_sumsq(x_ptr, offs_t, t_ok, K, BT, BKX)  # [BT]
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([BT, BN], tl.float32)
    acc2 = tl.zeros([BT, BN], tl.float32)
    if INTERPRET:  # the interpreter's scalars cannot bound a range()
        u = 0
        while u < units:
            acc, acc2 = _tiles_unit(x_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, u, pid, progs, offs_t, t_ok, rstd, acc, acc2,
                                    K, N, KC, NORM, BIAS, GLU, RESIDUAL, IEEE, BN, BK)
            u += 1
    else:
        for u in tl.range(0, units, num_stages=STAGES):
            acc, acc2 = _tiles_unit(x_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, u, pid, progs, offs_t, t_ok, rstd, acc, acc2,
                                    K, N, KC, NORM, BIAS, GLU, RESIDUAL, IEEE, BN, BK)
    if PDL and LATE:
        gdc_launch_dependents()


@triton.jit
def _tiles_unit(x_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, u, pid, progs, offs_t, t_ok, rstd, acc, acc2,
                K: tl.constexpr, N: tl.constexpr, KC: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                GLU: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Unit u of skinny_tiles' program pid: K chunk u % KC of its (u // KC)-th column block, added
    to acc (and acc2: up) [BT, BN]; the block's epilogue stored if the chunk is its last."""
    blk = pid + (u // KC) * progs
    kc = u % KC
    offs_n = blk * BN + tl.arange(0, BN)  # [BN]
    offs_k = kc * BK + tl.arange(0, BK)  # [BK]
    n_ok = offs_n < N
    k_ok = offs_k < K
    wmask = n_ok[:, None] & k_ok[None, :]
    wk = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)  # [BN, BK]
    xk = tl.load(x_ptr + offs_t[:, None] * K + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                 other=0.0)  # [BT, BK]
    if NORM:
        nwk = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        xk = (xk.to(tl.float32) * rstd[:, None] * nwk[None, :]).to(xk.dtype)
    acc += _dot(xk, wk, IEEE)  # [BT, BN]
    if GLU:
        uk = tl.load(w_ptr + (N + offs_n)[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)  # [BN, BK] up rows
        acc2 += _dot(xk, uk, IEEE)
    last = kc == KC - 1
    io = t_ok[:, None] & n_ok[None, :] & last  # [BT, BN]: only the unit that ends the block stores
    bias = tl.zeros([BN], tl.float32)
    if BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok & last, other=0.0).to(tl.float32)  # [BN]
    _epilogue(acc, acc2, bias, y_ptr + offs_t[:, None] * N + offs_n[None, :], io, BIAS, GLU, RESIDUAL, y_ptr)
    return tl.where(last, 0.0, acc), tl.where(last, 0.0, acc2)
