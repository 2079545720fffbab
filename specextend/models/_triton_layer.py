"""Triton kernels of fused_layer.py (imported lazily: Triton is optional; with TRITON_INTERPRET=1
set before Triton is first imported they run in Triton's CPU interpreter)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
ROUND = tl.constexpr(8)  # combine_block with sb >= SP: splits a round where few are in use
ONE_LOAD_FROM = tl.constexpr(16)  # ... and past this many in use, every split's output in one load


@triton.jit
def _fold(m_i, l_i, acc, m_blk, s_blk, a_blk):
    """Merge a block with running max m_blk [BM] (log2 units) into (m_i, l_i, acc): s_blk [BM] is
    the block's sum of 2^(x - m_blk), a_blk [BM, DP] its unnormalized output. -inf safe."""
    m_new = tl.maximum(m_i, m_blk)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    beta = tl.exp2(m_blk - m_safe)
    return m_new, l_i * alpha + s_blk * beta, acc * alpha[:, None] + a_blk * beta[:, None]


@triton.jit
def _partial(outp_ptr, lsep_ptr, g, s, n_used, offs_m, row_ok, offs_c, c_ok, m_safe, S, M, D: tl.constexpr):
    """Split s's weighted output w [BM, 1] * out_s [BM, DC] (0 past n_used) and its weight w [BM]."""
    ok = row_ok & (s < n_used)
    row = (g * S + s) * M + offs_m  # [BM]
    w = tl.exp2(tl.load(lsep_ptr + row, mask=ok, other=float("-inf")).to(tl.float32) * LOG2E - m_safe)
    o = tl.load(outp_ptr + row[:, None] * D + offs_c[None, :], mask=ok[:, None] & c_ok[None, :],
                other=0.0).to(tl.float32)
    return w[:, None] * o, w


@triton.jit
def _rounds(outp_ptr, lsep_ptr, g, n_used, offs_m, row_ok, offs_c, c_ok, m_safe, S, M,
            D: tl.constexpr, BLOCK_M: tl.constexpr, DC: tl.constexpr, RB: tl.constexpr, INTERPRET: tl.constexpr):
    """The splits' weighted outputs (acc [BM, DC]) and weights (l_i [BM]) summed RB splits a round,
    the round's loads independent (in flight together), up to split n_used."""
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DC], tl.float32)
    if INTERPRET:  # the interpreter's scalars cannot bound a range()
        s0 = 0
        while s0 < n_used:
            for j in tl.static_range(RB):
                a_j, w_j = _partial(outp_ptr, lsep_ptr, g, s0 + j, n_used, offs_m, row_ok, offs_c, c_ok, m_safe, S, M, D)
                acc += a_j
                l_i += w_j
            s0 += RB
    else:
        for s0 in range(0, n_used, RB):
            for j in tl.static_range(RB):
                a_j, w_j = _partial(outp_ptr, lsep_ptr, g, s0 + j, n_used, offs_m, row_ok, offs_c, c_ok, m_safe, S, M, D)
                acc += a_j
                l_i += w_j
    return acc, l_i


@triton.jit
def _tree_block(q, k_ptr, v_ptr, bias_ptr, n0, HI, N, g, stride_kg, stride_kn, stride_vg, stride_vn,
                offs_m, row_ok, offs_d, d_ok, offs_c, c_ok, scale_log2, m_i, l_i, acc,
                BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Tree keys [n0, min(n0 + BLOCK_N, HI)) of N folded into (m_i, l_i, acc) (combine_block's key
    loop; N is also the bias's row stride)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN]
    key_ok = offs_n < HI
    k = tl.load(k_ptr + g * stride_kg + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [BN, DP]
    v = tl.load(v_ptr + g * stride_vg + offs_n[:, None] * stride_vn + offs_c[None, :],
                mask=key_ok[:, None] & c_ok[None, :], other=0.0)  # [BN, DC]
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BM, BN]
    else:
        qk = tl.dot(q, tl.trans(k))  # exact products, float32 accumulation
    b = tl.load(bias_ptr + offs_m[:, None] * N + offs_n[None, :], mask=row_ok[:, None] & key_ok[None, :],
                other=float("-inf"))
    qk = qk * scale_log2 + b.to(tl.float32) * LOG2E
    m_blk = tl.max(qk, 1)
    p = tl.exp2(qk - tl.where(m_blk == float("-inf"), 0.0, m_blk)[:, None])
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")  # [BM, DC]
    else:
        p_hi = p.to(v.dtype)
        pv = tl.dot(p_hi, v) + tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v)
    return _fold(m_i, l_i, acc, m_blk, tl.sum(p, 1), pv)


@triton.jit
def _tree_range(q, k_ptr, v_ptr, bias_ptr, lo, hi, N, g, stride_kg, stride_kn, stride_vg, stride_vn,
                offs_m, row_ok, offs_d, d_ok, offs_c, c_ok, scale_log2, m_i, l_i, acc,
                BLOCK_N: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """Tree keys [lo, hi) folded into (m_i, l_i, acc), BLOCK_N at a time; two loops: the
    interpreter's scalars cannot bound a range()."""
    if INTERPRET:
        n0 = lo
        while n0 < hi:
            m_i, l_i, acc = _tree_block(q, k_ptr, v_ptr, bias_ptr, n0, hi, N, g, stride_kg, stride_kn, stride_vg,
                                        stride_vn, offs_m, row_ok, offs_d, d_ok, offs_c, c_ok, scale_log2, m_i, l_i,
                                        acc, BLOCK_N, IEEE)
            n0 += BLOCK_N
    else:
        for n0 in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _tree_block(q, k_ptr, v_ptr, bias_ptr, n0, hi, N, g, stride_kg, stride_kn, stride_vg,
                                        stride_vn, offs_m, row_ok, offs_d, d_ok, offs_c, c_ok, scale_log2, m_i, l_i,
                                        acc, BLOCK_N, IEEE)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["T", "N", "S"])
def tree_combine(q_ptr, k_ptr, v_ptr, bias_ptr, outp_ptr, lsep_ptr, out_ptr, lse_ptr, rng_ptr, scale_log2,
                 stride_kg, stride_kn, stride_vg, stride_vn, T, N, S,
                 R: tl.constexpr, SP: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, DC: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SB: tl.constexpr, NEED_LSE: tl.constexpr, IEEE: tl.constexpr,
                 INTERPRET: tl.constexpr, PDL: tl.constexpr = False, HAS_RNG: tl.constexpr = False):
    """One program: BLOCK_M folded rows (r = j * T + t: query head g * R + j, token t) of KV head g,
    head dims [c * DC, (c + 1) * DC). Softmax over the S prefix partials (each one column: its lse
    and normalized output) and the N tree keys (scores over all D + additive bias); writes
    out[t, g * R + j, chunk] and, if NEED_LSE, lse[g * R + j, t] (chunk 0).

    The partials in two passes: all S lse at once ([BM, SP], one load), whose maximum fixes every
    split's weight, then the weighted sum of the outputs, SB splits an iteration with no dependence
    between their loads (a running-max fold per split was a chain of S dependent steps: 13.5 us a
    call for the 1.5B's AR step at 16K on an H100, 2026-11-23); with SB >= SP every split's output
    comes in one load ([SP, BM, DC] registers, one memory round trip) where more than ONE_LOAD_FROM
    splits are in use, else rounds of ROUND (the whole tile's predicated loads cost the draft's level
    at 1K keys, 8 splits in use, 9.2-10.0 -> 11.8-12.7 us a layer on an H200; its working cache,
    1K keys plus the tokens since the last refresh, fills 9). Only splits up to the last non-empty
    one are read: a short cache fills few (prefix_partials' minimum chunk), and the draft's
    retrieval cache of ~1K keys read 64 splits, 14 us a call. Chunks of the head dim multiply the
    programs: each recomputes the tree scores (a small dot) and reads only its columns.
    Half-precision inputs (IEEE False) use the tensor cores with float32 accumulation: q.k products
    of bf16/fp16 values are exact in float32, and p (float32) goes in as p_hi + p_lo, two half
    values whose sum carries ~16 bits of it, so the result matches the float32 twin to well within
    the output's rounding. float32 inputs use IEEE float32 dots.

    T tokens, N tree keys and S splits are runtime values that Triton does not specialize on, so
    one compiled kernel serves every tree size of a bucket (the row block, the key block, the
    splits' power of two): a kernel per size cost ~0.8 s at start-up, most of the real pair's 226 s
    warm-up (H200, 2026-11-29, docs/architecture.md, "Execution plans"). (The key loop as a
    static_range over a compile-time block count made the persistent layer kernel's compile run
    for minutes.)"""
    if PDL:  # nothing to load before the wait: PDL hides the launch gap (specextend/pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    combine_block(q_ptr, k_ptr, v_ptr, bias_ptr, outp_ptr, lsep_ptr, out_ptr, lse_ptr, scale_log2,
                  stride_kg, stride_kn, stride_vg, stride_vn, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                  tl.num_programs(1), T, N, S, R, SP, D, DP, DC, BLOCK_M, BLOCK_N, SB, NEED_LSE, IEEE, INTERPRET,
                  rng_ptr, HAS_RNG)


@triton.jit
def combine_block(q_ptr, k_ptr, v_ptr, bias_ptr, outp_ptr, lsep_ptr, out_ptr, lse_ptr, scale_log2,
                  stride_kg, stride_kn, stride_vg, stride_vn, mb, g, c, NG, T, N, S,
                  R: tl.constexpr, SP: tl.constexpr,
                  D: tl.constexpr, DP: tl.constexpr, DC: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, SB: tl.constexpr, NEED_LSE: tl.constexpr, IEEE: tl.constexpr,
                  INTERPRET: tl.constexpr, rng_ptr=None, HAS_RNG: tl.constexpr = False):
    """tree_combine's program (mb, g, c) of NG KV heads (also a work item of the persistent layer
    kernel, models/_triton_persist.py). With HAS_RNG, rng_ptr holds each token's two key ranges
    [T, 4] int32 (lo1, hi1, lo2, hi2) outside which its mask is false: a batched forward's rows see
    only their own session's staged and new keys (full_graphs.batch_key_ranges), so the block's
    rows read the union of their tokens' ranges, not all N keys of every session."""
    M = R * T
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_d = tl.arange(0, DP)  # [DP] all head dims (scores)
    offs_c = c * DC + tl.arange(0, DC)  # [DC] this program's head dims (outputs)
    offs_s = tl.arange(0, SP)  # [SP]
    row_ok = offs_m < M
    d_ok = offs_d < D
    c_ok = offs_c < D
    io = row_ok[:, None] & c_ok[None, :]  # [BM, DC]
    q = tl.load(q_ptr + (g * M + offs_m)[:, None] * D + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, DP]
    # pass 1: every split's lse -> the prefix maximum and the splits in use
    ls = tl.load(lsep_ptr + (g * S + offs_s)[None, :] * M + offs_m[:, None],
                 mask=row_ok[:, None] & (offs_s < S)[None, :], other=float("-inf")).to(tl.float32) * LOG2E  # [BM, SP]
    m_i = tl.max(ls, 1)  # [BM]
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    n_used = tl.max(tl.max(tl.where(ls > float("-inf"), offs_s[None, :] + 1, 0), 1), 0)  # splits 0..n_used-1
    # pass 2: sum of w_s * out_s: every split's output in one load, or rounds of independent loads
    if SB >= SP and SP > ONE_LOAD_FROM:  # (fewer splits: no one-load code at all, a spill at one shape)
        if n_used > ONE_LOAD_FROM:  # one memory round trip ([SP, BM, DC] in registers)
            w = tl.exp2(ls - m_safe[:, None])  # [BM, SP]: 0 for the empty splits (lse -inf) and those past S
            o_ok = (offs_s < n_used)[:, None, None] & io[None, :, :]  # [SP, BM, DC]
            rows3 = ((g * S + offs_s)[:, None] * M + offs_m[None, :])[:, :, None]  # [SP, BM, 1]
            o = tl.load(outp_ptr + rows3 * D + offs_c[None, None, :], mask=o_ok, other=0.0).to(tl.float32)
            acc = tl.sum(tl.trans(w)[:, :, None] * o, 0)  # [BM, DC]
            l_i = tl.sum(w, 1)
        else:  # a short cache fills few splits (the draft's retrieval cache): the rounds of 8
            acc, l_i = _rounds(outp_ptr, lsep_ptr, g, n_used, offs_m, row_ok, offs_c, c_ok, m_safe,
                               S, M, D, BLOCK_M, DC, ROUND, INTERPRET)
    elif SB >= SP:
        acc, l_i = _rounds(outp_ptr, lsep_ptr, g, n_used, offs_m, row_ok, offs_c, c_ok, m_safe,
                           S, M, D, BLOCK_M, DC, ROUND, INTERPRET)
    else:
        acc, l_i = _rounds(outp_ptr, lsep_ptr, g, n_used, offs_m, row_ok, offs_c, c_ok, m_safe,
                           S, M, D, BLOCK_M, DC, SB, INTERPRET)
    # tree keys, masked by the additive bias (half precision: one block up to 64 keys), in at most two
    # ranges (HAS_RNG: the rows' own sessions' staged keys, then their new keys; else all N)
    if HAS_RNG:
        tok = offs_m % T
        lo1 = tl.min(tl.load(rng_ptr + tok * 4, mask=row_ok, other=N), 0)
        hi1 = tl.max(tl.load(rng_ptr + tok * 4 + 1, mask=row_ok, other=0), 0)
        lo2 = tl.min(tl.load(rng_ptr + tok * 4 + 2, mask=row_ok, other=N), 0)
        hi2 = tl.max(tl.load(rng_ptr + tok * 4 + 3, mask=row_ok, other=0), 0)
        m_i, l_i, acc = _tree_range(q, k_ptr, v_ptr, bias_ptr, lo1, hi1, N, g, stride_kg, stride_kn, stride_vg,
                                    stride_vn, offs_m, row_ok, offs_d, d_ok, offs_c, c_ok, scale_log2, m_i, l_i, acc,
                                    BLOCK_N, IEEE, INTERPRET)
        m_i, l_i, acc = _tree_range(q, k_ptr, v_ptr, bias_ptr, lo2, hi2, N, g, stride_kg, stride_kn, stride_vg,
                                    stride_vn, offs_m, row_ok, offs_d, d_ok, offs_c, c_ok, scale_log2, m_i, l_i, acc,
                                    BLOCK_N, IEEE, INTERPRET)
    else:
        m_i, l_i, acc = _tree_range(q, k_ptr, v_ptr, bias_ptr, 0, N, N, g, stride_kg, stride_kn, stride_vg,
                                    stride_vn, offs_m, row_ok, offs_d, d_ok, offs_c, c_ok, scale_log2, m_i, l_i, acc,
                                    BLOCK_N, IEEE, INTERPRET)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    j = offs_m // T
    t = offs_m % T
    dst = t * (R * NG * D) + (g * R + j) * D  # [T, H, D] layout: o-proj input
    tl.store(out_ptr + dst[:, None] + offs_c[None, :], out.to(out_ptr.dtype.element_ty), mask=io)
    if NEED_LSE:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
        tl.store(lse_ptr + g * M + offs_m, lse, mask=row_ok & (c == 0))


@triton.jit(do_not_specialize=["T"])
def rope_scatter(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kpre_ptr,
                 stride_kg, stride_kt, stride_vg, stride_vt, stride_pg, stride_pt, T,
                 H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                 STORE_PRE: tl.constexpr, PDL: tl.constexpr = False,
                 x_ptr=None, b_ptr=None, eps=0.0, E: tl.constexpr = 1, EP: tl.constexpr = 1,
                 NORM: tl.constexpr = False, BIAS: tl.constexpr = False):
    """One program per (token t, head j of the H + 2G in qkv [T, (H + 2G) * D]): RoPE (rotate-half,
    signed sine) on q and k heads, then q -> q [H, T, D], k -> k [G, T, D], v -> v [G, T, D] and the
    pre-RoPE k -> kpre (strided destinations). Rounds x * cos to the storage dtype before adding
    x_rot * sin, as apply_rope's two kernels do. NORM (folded norms: fused_layer.fold_norms): qkv
    is x @ (W * w_norm).T, so each value is first scaled by row t's 1/RMS of x [T, E] (read here)
    and the bias b added (BIAS), rounded once to the storage dtype."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0)
    j = tl.program_id(1)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < D
    src = qkv_ptr + t * (H + 2 * G) * D + j * D
    x = tl.load(src + offs_d, mask=d_ok, other=0.0)
    xr = tl.load(src + (offs_d + D // 2) % D, mask=d_ok, other=0.0)
    if NORM:
        offs_e = tl.arange(0, EP)
        xe = tl.load(x_ptr + t * E + offs_e, mask=offs_e < E, other=0.0).to(tl.float32)  # [EP] row t of x
        rstd = 1.0 / tl.sqrt(tl.sum(xe * xe, 0) / E + eps)
        xf = x.to(tl.float32) * rstd
        xrf = xr.to(tl.float32) * rstd
        if BIAS:
            xf += tl.load(b_ptr + j * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            xrf += tl.load(b_ptr + j * D + (offs_d + D // 2) % D, mask=d_ok, other=0.0).to(tl.float32)
        x = xf.to(x.dtype)
        xr = xrf.to(x.dtype)
    c = tl.load(cos_ptr + t * D + offs_d, mask=d_ok, other=0.0)
    sn = tl.load(sin_ptr + t * D + offs_d, mask=d_ok, other=0.0)
    xc = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
    y = (xc.to(tl.float32) + xr.to(tl.float32) * sn.to(tl.float32)).to(x.dtype)
    tl.store(q_ptr + (j * T + t) * D + offs_d, y, mask=d_ok & (j < H))
    kj = j - H
    is_k = (j >= H) & (j < H + G)
    tl.store(k_ptr + kj * stride_kg + t * stride_kt + offs_d, y, mask=d_ok & is_k)
    if STORE_PRE:
        tl.store(kpre_ptr + kj * stride_pg + t * stride_pt + offs_d, x, mask=d_ok & is_k)
    vj = j - H - G
    tl.store(v_ptr + vj * stride_vg + t * stride_vt + offs_d, x, mask=d_ok & (j >= H + G))


@triton.jit
def silu_mul(gu_ptr, out_ptr, I: tl.constexpr, BLOCK: tl.constexpr,
             x_ptr=None, eps=0.0, E: tl.constexpr = 1, EP: tl.constexpr = 1, NORM: tl.constexpr = False):
    """gu [T, 2I] (gate | up) -> out [T, I] = silu(gate) * up, silu rounded to the storage dtype
    first (as F.silu(gate) * up). NORM (folded norms: fused_layer.fold_norms): gu is
    x @ (W * w_norm).T, so gate and up are first scaled by row t's 1/RMS of x [T, E] (read here),
    each rounded once to the storage dtype."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    gate = tl.load(gu_ptr + t * 2 * I + offs, mask=ok, other=0.0)
    up = tl.load(gu_ptr + t * 2 * I + I + offs, mask=ok, other=0.0)
    if NORM:
        offs_e = tl.arange(0, EP)
        xe = tl.load(x_ptr + t * E + offs_e, mask=offs_e < E, other=0.0).to(tl.float32)  # [EP] row t of x
        rstd = 1.0 / tl.sqrt(tl.sum(xe * xe, 0) / E + eps)
        gate = (gate.to(tl.float32) * rstd).to(up.dtype)
        up = (up.to(tl.float32) * rstd).to(up.dtype)
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
    tl.store(out_ptr + t * I + offs, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


@triton.jit
def rms_norm(x_ptr, w_ptr, out_ptr, eps, E: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row of x [T, E]: out = x * rsqrt(mean(x^2) + eps) * w, in float32, rounded
    once to the storage dtype (as F.rms_norm)."""
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < E
    x = tl.load(x_ptr + t * E + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / E + eps)
    tl.store(out_ptr + t * E + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)
