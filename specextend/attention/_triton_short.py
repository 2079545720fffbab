"""Triton kernel of triton_short.py (imported lazily: Triton is optional; with TRITON_INTERPRET=1 set
before Triton is first imported it runs in Triton's CPU interpreter)."""

import triton
import triton.language as tl

from specextend.attention._triton_kernels import key_block

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit(do_not_specialize=["layer"])  # one compiled kernel for every layer (its value does not matter)
def short_attention(q_ptr, kv_ptr, meta_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, lse_ptr, scale_log2, layer,
                    stride_kg, stride_kn, stride_vg, stride_vn,
                    T: tl.constexpr, R: tl.constexpr, N: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                    DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TREE_N: tl.constexpr,
                    NEED_LSE: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """One program: BLOCK_M folded rows (r = j * T + t: query head g * R + j, token t) of KV head g.
    One online softmax over every committed key of the cache's layer `layer` (found through meta,
    as prefix_partials does: no mask), then over the N staged tree keys with the additive bias;
    writes out[t, (g * R + j) * D + d] (the o-projection's [T, H * D] layout) and, if NEED_LSE,
    lse[g * R + j, t] (natural log).

    The committed keys go through prefix_partials' own block update (key_block: p rounded to the
    cache's dtype for the P.V dot, as there). The tree keys, as tree_combine does them: a row may
    see none of a block's keys (bias -inf), so the update is -inf safe, and half-precision p goes
    in as p_hi + p_lo (two dots) so that the tree part keeps ~16 bits of p."""
    mb = tl.program_id(0)
    g = tl.program_id(1)
    M: tl.constexpr = R * T
    idx = tl.arange(0, 4)
    mv = tl.load(meta_ptr + idx)  # [4] (offset, L, capacity, unused): scalars by reduction
    off = tl.sum(tl.where(idx == 0, mv, 0), 0) // 16 * 16  # a multiple of 16: aligned, vectorized loads
    L = tl.sum(tl.where(idx == 1, mv, 0), 0).to(tl.int32)  # an int32 loop: i64 loops are not pipelined
    cap = tl.sum(tl.where(idx == 2, mv, 0), 0)
    kv = kv_ptr + off  # the cache [layers, 2, G, cap, D]
    kc_ptr = kv + ((layer * 2 + 0) * G + g) * cap * D  # [cap, D] of layer, head g
    vc_ptr = kv + ((layer * 2 + 1) * G + g) * cap * D
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_d = tl.arange(0, DP)  # [DP] head dims padded to a power of two
    row_ok = offs_m < M
    d_ok = offs_d < D
    io = row_ok[:, None] & d_ok[None, :]  # [BM, DP]
    q = tl.load(q_ptr + (g * M + offs_m)[:, None] * D + offs_d[None, :], mask=io, other=0.0)  # [BM, DP]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    # committed keys [0, L): two loops, the interpreter's scalars cannot bound a range() (numpy 2),
    # and a while loop would not be software-pipelined when compiled
    if INTERPRET:
        n0 = 0
        while n0 < L:
            m_i, l_i, acc = key_block(q, kc_ptr, vc_ptr, n0, L, offs_d, m_i, l_i, acc, scale_log2, D, BLOCK_N, IEEE)
            n0 += BLOCK_N
    else:
        for n0 in range(0, L, BLOCK_N):
            m_i, l_i, acc = key_block(q, kc_ptr, vc_ptr, n0, L, offs_d, m_i, l_i, acc, scale_log2, D, BLOCK_N, IEEE)
    for t0 in range(0, N, TREE_N):  # staged tree keys, masked by the additive bias
        offs_n = t0 + tl.arange(0, TREE_N)  # [TN]
        key_ok = offs_n < N
        ld = key_ok[:, None] & d_ok[None, :]  # [TN, DP]
        k = tl.load(k_ptr + g * stride_kg + offs_n[:, None] * stride_kn + offs_d[None, :], mask=ld, other=0.0)
        v = tl.load(v_ptr + g * stride_vg + offs_n[:, None] * stride_vn + offs_d[None, :], mask=ld, other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BM, TN]
        else:
            qk = tl.dot(q, tl.trans(k))  # exact products, float32 accumulation
        b = tl.load(bias_ptr + offs_m[:, None] * N + offs_n[None, :], mask=row_ok[:, None] & key_ok[None, :],
                    other=float("-inf"))
        qk = qk * scale_log2 + b.to(tl.float32) * LOG2E
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(qk - m_safe[:, None])  # [BM, TN]
        alpha = tl.exp2(m_i - m_safe)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")  # [BM, DP]
        else:
            p_hi = p.to(v.dtype)
            pv = tl.dot(p_hi, v) + tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]  # a row that saw no key: 0
    j = offs_m // T
    t = offs_m % T
    dst = t * (R * G * D) + (g * R + j) * D  # [BM]: [T, H * D], the o-projection's input
    tl.store(out_ptr + dst[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io)
    if NEED_LSE:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
        tl.store(lse_ptr + g * M + offs_m, lse, mask=row_ok)
