"""Triton kernel of persistent.py: a whole decoder layer of a decode-time forward in one launch
(imported lazily: Triton is optional; with TRITON_INTERPRET=1 set before Triton is first imported
it runs in Triton's CPU interpreter, one stage per launch).

Six stages, each a set of independent work items spread over the programs:

    1  RMSNorm + QKV (+ bias) + RoPE; q -> q [H, T, D], k/v (and pre-RoPE k) -> the tree scratch
    2  prefix attention: one split of the committed keys per (row block, split, KV head)
    3  tree part + merge of the splits (combine_block) -> attn [T, H * D]
    4  o-projection + residual, in place on x [T, E]
    5  RMSNorm + gate/up + SiLU * up -> act [T, I]
    6  down projection + residual, in place on x

STAGE < 0 runs all six in one cooperative launch (every program resident), a grid barrier
between stages; STAGE = k runs stage k alone, one item per program: the twin, and the only way
the interpreter (which runs programs one after another) can run it.
"""

import triton
import triton.language as tl

from specextend.attention._triton_kernels import prefix_split
from specextend.models._triton_layer import combine_block


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _grid_sync(sync_ptr, target):
    """Every program waits here until the counter reaches `target` (this barrier's count times the
    programs); writes before it are visible to every program after it. The counter is zeroed before
    the forward (persistent.py)."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _rstd(x_ptr, eps, offs_t, t_ok, E: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """1 / RMS of each row of x [T, E] -> [BT] float32."""
    ss = tl.zeros([BT], tl.float32)
    for k0 in tl.static_range(0, E, BK):  # unrolled: every chunk's load in flight at once
        offs_k = k0 + tl.arange(0, BK)
        xk = tl.load(x_ptr + offs_t[:, None] * E + offs_k[None, :], mask=t_ok[:, None] & (offs_k < E)[None, :],
                     other=0.0).to(tl.float32)
        ss += tl.sum(xk * xk, 1)
    return 1.0 / tl.sqrt(ss / E + eps)


@triton.jit
def _normed(x_ptr, nw_ptr, rstd, offs_t, t_ok, k0, E: tl.constexpr, BK: tl.constexpr):
    """Columns [k0, k0 + BK) of RMSNorm(x) [BT, BK], rounded to x's dtype (as fused_layer.rms_norm)."""
    offs_k = k0 + tl.arange(0, BK)
    k_ok = offs_k < E
    x = tl.load(x_ptr + offs_t[:, None] * E + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
    w = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    return (x.to(tl.float32) * rstd[:, None] * w[None, :]).to(x.dtype), offs_k, k_ok


@triton.jit
def _qkv_item(it, x_ptr, nw_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr,
              skg, skt, svg, svt, spg, spt, rstd,
              T: tl.constexpr, E: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
              STORE_PRE: tl.constexpr, IEEE: tl.constexpr, KS: tl.constexpr):
    """Item `it` = (head j of the H + 2G, chunk c of its first half): columns j*D + [c*BC, c*BC + BC)
    and the same + D/2 (the pairs RoPE rotates together). As fused_layer.layer_pre: norm, QKV (+
    bias) rounded to the storage dtype, RoPE as rope_scatter (x * cos rounded, then + x_rot * sin)."""
    HALF: tl.constexpr = D // 2
    CH: tl.constexpr = (HALF + BC - 1) // BC
    j = it // CH
    c = it % CH
    offs_t = tl.arange(0, BT)
    t_ok = offs_t < T
    offs_c = c * BC + tl.arange(0, BC)  # [BC] dims of the first half
    c_ok = offs_c < HALF
    col = j * D + offs_c  # [BC] rows of w [(H + 2G) * D, E]
    acc_lo = tl.zeros([BT, BC], tl.float32)
    acc_hi = tl.zeros([BT, BC], tl.float32)
    for k0 in tl.range(0, E, BK, num_stages=KS):
        xn, offs_k, k_ok = _normed(x_ptr, nw_ptr, rstd, offs_t, t_ok, k0, E, BK)  # [BT, BK]
        wm = k_ok[:, None] & c_ok[None, :]
        wl = tl.load(w_ptr + col[None, :] * E + offs_k[:, None], mask=wm, other=0.0)  # [BK, BC]
        wh = tl.load(w_ptr + (col + HALF)[None, :] * E + offs_k[:, None], mask=wm, other=0.0)
        acc_lo += _dot(xn, wl, IEEE)
        acc_hi += _dot(xn, wh, IEEE)
    if HAS_BIAS:
        acc_lo += tl.load(b_ptr + col, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc_hi += tl.load(b_ptr + col + HALF, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    dt = x_ptr.dtype.element_ty
    ylo = acc_lo.to(dt)  # [BT, BC] the linear's output, rounded
    yhi = acc_hi.to(dt)
    io = t_ok[:, None] & c_ok[None, :]
    tab = offs_t[:, None] * D + offs_c[None, :]  # [BT, BC] into the [T, D] tables
    cl = tl.load(cos_ptr + tab, mask=io, other=0.0).to(tl.float32)
    chh = tl.load(cos_ptr + tab + HALF, mask=io, other=0.0).to(tl.float32)
    sl = tl.load(sin_ptr + tab, mask=io, other=0.0).to(tl.float32)  # signed sine (Rope.cos_sin)
    sh = tl.load(sin_ptr + tab + HALF, mask=io, other=0.0).to(tl.float32)
    flo = ylo.to(tl.float32)
    fhi = yhi.to(tl.float32)
    rlo = ((flo * cl).to(dt).to(tl.float32) + fhi * sl).to(dt)
    rhi = ((fhi * chh).to(dt).to(tl.float32) + flo * sh).to(dt)
    lo = offs_c[None, :]
    hi = lo + HALF
    is_q = j < H
    qr = ((j * T + offs_t) * D)[:, None]  # q [H, T, D]
    tl.store(q_ptr + qr + lo, rlo, mask=io & is_q)
    tl.store(q_ptr + qr + hi, rhi, mask=io & is_q)
    is_k = (j >= H) & (j < H + G)
    kr = ((j - H) * skg + offs_t * skt)[:, None]
    tl.store(k_ptr + kr + lo, rlo, mask=io & is_k)
    tl.store(k_ptr + kr + hi, rhi, mask=io & is_k)
    if STORE_PRE:
        pr = ((j - H) * spg + offs_t * spt)[:, None]
        tl.store(kp_ptr + pr + lo, ylo, mask=io & is_k)
        tl.store(kp_ptr + pr + hi, yhi, mask=io & is_k)
    is_v = j >= H + G
    vr = ((j - H - G) * svg + offs_t * svt)[:, None]
    tl.store(v_ptr + vr + lo, ylo, mask=io & is_v)
    tl.store(v_ptr + vr + hi, yhi, mask=io & is_v)


@triton.jit
def _linres_item(it, a_ptr, w_ptr, x_ptr, T: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                 BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, KS: tl.constexpr):
    """x[:, cols] += a [T, K] @ w[cols, :]^T for the BN columns of item `it`, in float32, rounded once
    (as x.addmm_(a, w.t()))."""
    offs_t = tl.arange(0, BT)
    t_ok = offs_t < T
    offs_n = it * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    acc = tl.zeros([BT, BN], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=KS):  # KS chunks of the weights in flight
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        a = tl.load(a_ptr + offs_t[:, None] * K + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += _dot(a, w, IEEE)
    io = t_ok[:, None] & n_ok[None, :]
    xp = x_ptr + offs_t[:, None] * N + offs_n[None, :]
    x = tl.load(xp, mask=io, other=0.0)
    tl.store(xp, (x.to(tl.float32) + acc).to(x.dtype), mask=io)


@triton.jit
def _glu_item(it, x_ptr, nw_ptr, w_ptr, act_ptr, rstd, T: tl.constexpr, E: tl.constexpr, I: tl.constexpr,
              BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, KS: tl.constexpr):
    """act[:, cols] = silu(gate) * up for the BN columns of item `it`, gate/up = RMSNorm(x) @ w^T
    (w [2I, E]: gate rows, then up rows), each rounded as fused_layer's silu_mul does."""
    offs_t = tl.arange(0, BT)
    t_ok = offs_t < T
    offs_n = it * BN + tl.arange(0, BN)
    n_ok = offs_n < I
    acc_g = tl.zeros([BT, BN], tl.float32)
    acc_u = tl.zeros([BT, BN], tl.float32)
    for k0 in tl.range(0, E, BK, num_stages=KS):
        xn, offs_k, k_ok = _normed(x_ptr, nw_ptr, rstd, offs_t, t_ok, k0, E, BK)
        wm = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_ptr + offs_n[None, :] * E + offs_k[:, None], mask=wm, other=0.0)  # [BK, BN]
        wu = tl.load(w_ptr + (offs_n + I)[None, :] * E + offs_k[:, None], mask=wm, other=0.0)
        acc_g += _dot(xn, wg, IEEE)
        acc_u += _dot(xn, wu, IEEE)
    dt = x_ptr.dtype.element_ty
    gf = acc_g.to(dt).to(tl.float32)
    uf = acc_u.to(dt).to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32) * uf
    tl.store(act_ptr + offs_t[:, None] * I + offs_n[None, :], act.to(dt), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def layer_kernel(x_ptr, nw1_ptr, wqkv_ptr, bqkv_ptr, cos_ptr, sin_ptr, q_ptr,
                 k_ptr, v_ptr, kp_ptr, skg, skt, svg, svt, spg, spt,
                 kv_ptr, meta_ptr, layer, outp_ptr, lsep_ptr,
                 kt_ptr, vt_ptr, stg, stn, svtg, svtn, bias_ptr, attn_ptr, lse_ptr,
                 wo_ptr, nw2_ptr, wgu_ptr, act_ptr, wd_ptr, sync_ptr, eps, scale_log2,
                 T: tl.constexpr, E: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, I: tl.constexpr, N: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PBM: tl.constexpr, PBN: tl.constexpr, MIN_CHUNK: tl.constexpr,
                 CBM: tl.constexpr, CBN: tl.constexpr, DC: tl.constexpr, SB: tl.constexpr,
                 HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr, NEED_LSE: tl.constexpr,
                 IEEE: tl.constexpr, INTERPRET: tl.constexpr, STAGE: tl.constexpr, KS: tl.constexpr):
    """One decoder layer (see the module docstring); shapes and layouts as persistent.run_layer's."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    R: tl.constexpr = H // G
    M: tl.constexpr = R * T
    N1: tl.constexpr = (H + 2 * G) * ((D // 2 + BC - 1) // BC)
    MB2: tl.constexpr = (M + PBM - 1) // PBM
    N2: tl.constexpr = MB2 * S * G
    C3: tl.constexpr = (D + DC - 1) // DC
    N3: tl.constexpr = ((M + CBM - 1) // CBM) * G * C3
    N4: tl.constexpr = (E + BN - 1) // BN
    N5: tl.constexpr = (I + BN - 1) // BN
    ALL: tl.constexpr = STAGE < 0
    offs_t = tl.arange(0, BT)
    t_ok = offs_t < T
    if ALL or STAGE == 1:
        rstd = _rstd(x_ptr, eps, offs_t, t_ok, E, BT, BK)  # once per program: x is the stage's input
        it = pid
        while it < N1:
            _qkv_item(it, x_ptr, nw1_ptr, wqkv_ptr, bqkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr,
                      skg, skt, svg, svt, spg, spt, rstd, T, E, H, G, D, BT, BC, BK, HAS_BIAS, STORE_PRE, IEEE, KS)
            it += P
    if ALL:
        _grid_sync(sync_ptr, P)
    if ALL or STAGE == 2:
        it = pid
        while it < N2:
            prefix_split(q_ptr, kv_ptr, meta_ptr, outp_ptr, lsep_ptr, scale_log2, layer, M,
                         it // (S * G), (it // G) % S, it % G, 0, M, 1, S, G, D, DP, PBM, PBN, MIN_CHUNK, IEEE, INTERPRET)
            it += P
    if ALL:
        _grid_sync(sync_ptr, 2 * P)
    if ALL or STAGE == 3:
        it = pid
        while it < N3:
            combine_block(q_ptr, kt_ptr, vt_ptr, bias_ptr, outp_ptr, lsep_ptr, attn_ptr, lse_ptr, scale_log2,
                          stg, stn, svtg, svtn, it // (G * C3), (it // C3) % G, it % C3, G,
                          T, N, S, R, SP, D, DP, DC, CBM, CBN, SB, NEED_LSE, IEEE, INTERPRET)
            it += P
    if ALL:
        _grid_sync(sync_ptr, 3 * P)
    if ALL or STAGE == 4:
        it = pid
        while it < N4:
            _linres_item(it, attn_ptr, wo_ptr, x_ptr, T, H * D, E, BT, BN, BK, IEEE, KS)
            it += P
    if ALL:
        _grid_sync(sync_ptr, 4 * P)
    if ALL or STAGE == 5:
        rstd = _rstd(x_ptr, eps, offs_t, t_ok, E, BT, BK)
        it = pid
        while it < N5:
            _glu_item(it, x_ptr, nw2_ptr, wgu_ptr, act_ptr, rstd, T, E, I, BT, BN, BK, IEEE, KS)
            it += P
    if ALL:
        _grid_sync(sync_ptr, 5 * P)
    if ALL or STAGE == 6:
        it = pid
        while it < N4:
            _linres_item(it, act_ptr, wd_ptr, x_ptr, T, I, E, BT, BN, BK, IEEE, KS)
            it += P
