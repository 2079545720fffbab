"""Triton kernel of persistent.py: a whole decoder layer of a decode-time forward in one launch
(imported lazily: Triton is optional; with TRITON_INTERPRET=1 set before Triton is first imported
it runs in Triton's CPU interpreter, one stage per launch).

Six stages, each a set of independent work items spread over the programs (the projections as
stream-K: equal runs of (column tile, reduction chunk) units per program, see _stream):

    1  RMSNorm + QKV (+ bias) + RoPE; q -> q [H, T, D], k/v (and pre-RoPE k) -> the tree scratch
    2  prefix attention: one split of the committed keys per (row block, split, KV head)
    3  tree part + merge of the splits (combine_block) -> attn [T, H * D]
    4  o-projection + residual, in place on x [T, E]
    5  RMSNorm + gate/up + SiLU * up -> act [T, I]
    6  down projection + residual, in place on x

STAGE < 0 runs all six in one cooperative launch (every program resident), a grid barrier
between stages; STAGE = k runs stage k alone (attention: one item per program; projections: the
same programs and units as the one launch, so the same sums): the twin, and the only way the
interpreter (which runs programs one after another) can run it.
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


QKV = tl.constexpr(0)  # the kinds of projection stage (_stream's KIND)
LINRES = tl.constexpr(1)
GLU = tl.constexpr(2)


@triton.jit
def _cols(KIND: tl.constexpr, t, NCOL: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
    """Tile t's first BN output columns (rows of the weight) and their mask. QKV: head j, chunk c of
    its first half (the second set, + D/2, holds the pairs RoPE rotates together); else columns
    t * BN + [0, BN) of NCOL."""
    if KIND == QKV:
        HALF: tl.constexpr = D // 2
        CH: tl.constexpr = (HALF + BN - 1) // BN
        offs = (t % CH) * BN + tl.arange(0, BN)
        return (t // CH) * D + offs, offs < HALF
    else:
        offs = t * BN + tl.arange(0, BN)
        return offs, offs < NCOL


@triton.jit
def _unit(u, acc_a, acc_b, KIND: tl.constexpr, a_ptr, nw_ptr, rstd, w_ptr, offs_t, t_ok,
          K: tl.constexpr, KC: tl.constexpr, NCOL: tl.constexpr, OFFB: tl.constexpr, D: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr, NORM: tl.constexpr, IEEE: tl.constexpr):
    """Unit u = (tile u // KC, chunk u % KC of the reduction): acc_a [BT, BN] += a[:, chunk] @ w[cols,
    chunk]^T, and acc_b for the columns + OFFB when TWO. a is RMSNorm(x) when NORM (rstd [BT])."""
    t = u // KC
    k0 = (u % KC) * BK
    cols, c_ok = _cols(KIND, t, NCOL, D, BN)
    if NORM:
        a, offs_k, k_ok = _normed(a_ptr, nw_ptr, rstd, offs_t, t_ok, k0, K, BK)  # [BT, BK]
    else:
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        a = tl.load(a_ptr + offs_t[:, None] * K + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
    wm = k_ok[:, None] & c_ok[None, :]
    acc_a += _dot(a, tl.load(w_ptr + cols[None, :] * K + offs_k[:, None], mask=wm, other=0.0), IEEE)  # [BK, BN]
    if TWO:
        acc_b += _dot(a, tl.load(w_ptr + (cols + OFFB)[None, :] * K + offs_k[:, None], mask=wm, other=0.0), IEEE)
    return acc_a, acc_b


@triton.jit
def _tile_sums(t, u0, u1, pid, P, part_ptr, cnt_ptr, U: tl.constexpr, KC: tl.constexpr, MAXP: tl.constexpr,
               BT: tl.constexpr, BN: tl.constexpr, TWO: tl.constexpr):
    """Tile t, of which this program (units [u0, u1)) wrote a partial -> (the tile's sums [BT, BN] x 2,
    whether this program finishes it). A tile whole in one program is its own. A tile shared by
    programs: each adds its unit count to the tile's counter; the program that completes the count
    sums every partial in the order of the programs (of the reduction: deterministic, whatever the
    arrival order), resets the counter and finishes the tile."""
    offs = tl.arange(0, BT)[:, None] * BN + tl.arange(0, BN)[None, :]  # [BT, BN]
    ks = tl.maximum(u0 - t * KC, 0)
    n = tl.minimum(u1 - t * KC, KC) - ks  # units of the tile done here
    ready = n == KC
    if ready:
        sl = part_ptr + (pid * MAXP + t - u0 // KC) * (2 * BT * BN)
        acc_a = tl.load(sl + offs)
        if TWO:
            acc_b = tl.load(sl + BT * BN + offs)
        else:
            acc_b = tl.zeros([BT, BN], tl.float32)
    else:
        acc_a = tl.zeros([BT, BN], tl.float32)
        acc_b = tl.zeros([BT, BN], tl.float32)
        old = tl.atomic_add(cnt_ptr + t, n, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        ready = old + n == KC
        if ready:
            p = ((t * KC + 1) * P - 1) // U  # the program holding the tile's first unit
            last = ((t * KC + KC) * P - 1) // U
            while p <= last:
                pu0 = p * U // P
                has = (p + 1) * U // P > pu0  # with more programs than units, some have none
                sl = part_ptr + (p * MAXP + t - pu0 // KC) * (2 * BT * BN)
                acc_a += tl.load(sl + offs, mask=has, other=0.0, cache_modifier=".cg")
                if TWO:
                    acc_b += tl.load(sl + BT * BN + offs, mask=has, other=0.0, cache_modifier=".cg")
                p += 1
            tl.store(cnt_ptr + t, 0)
    return acc_a, acc_b, ready


@triton.jit
def _qkv_out(t, acc_lo, acc_hi, x_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr,
             skg, skt, svg, svt, spg, spt, offs_t, t_ok, T: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
             D: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr):
    """QKV tile t's epilogue, as fused_layer.layer_pre: (+ bias) rounded to the storage dtype, RoPE as
    rope_scatter (x * cos rounded, then + x_rot * sin), stored to q [H, T, D] or the K/V scratch."""
    HALF: tl.constexpr = D // 2
    CH: tl.constexpr = (HALF + BN - 1) // BN
    j = t // CH
    offs_c = (t % CH) * BN + tl.arange(0, BN)  # [BN] dims of the first half
    c_ok = offs_c < HALF
    col = j * D + offs_c
    if HAS_BIAS:
        acc_lo += tl.load(b_ptr + col, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc_hi += tl.load(b_ptr + col + HALF, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    dt = x_ptr.dtype.element_ty
    ylo = acc_lo.to(dt)  # [BT, BN] the linear's output, rounded
    yhi = acc_hi.to(dt)
    io = t_ok[:, None] & c_ok[None, :]
    tab = offs_t[:, None] * D + offs_c[None, :]  # [BT, BN] into the [T, D] tables
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
def _tile_out(KIND: tl.constexpr, t, acc_a, acc_b, x_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr,
              skg, skt, svg, svt, spg, spt, out_ptr, offs_t, t_ok, NCOL: tl.constexpr, T: tl.constexpr,
              H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
              STORE_PRE: tl.constexpr):
    """Tile t's epilogue: QKV's; LINRES x[:, cols] += acc_a rounded once (as x.addmm_(a, w.t()));
    GLU out[:, cols] = silu(gate) * up, each rounded as fused_layer's silu_mul does."""
    if KIND == QKV:
        _qkv_out(t, acc_a, acc_b, x_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr,
                 skg, skt, svg, svt, spg, spt, offs_t, t_ok, T, H, G, D, BN, HAS_BIAS, STORE_PRE)
    else:
        offs_n = t * BN + tl.arange(0, BN)
        io = t_ok[:, None] & (offs_n < NCOL)[None, :]
        dt = x_ptr.dtype.element_ty
        if KIND == LINRES:
            xp = x_ptr + offs_t[:, None] * NCOL + offs_n[None, :]
            x = tl.load(xp, mask=io, other=0.0)
            tl.store(xp, (x.to(tl.float32) + acc_a).to(dt), mask=io)
        else:
            gf = acc_a.to(dt).to(tl.float32)
            uf = acc_b.to(dt).to(tl.float32)
            act = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32) * uf
            tl.store(out_ptr + offs_t[:, None] * NCOL + offs_n[None, :], act.to(dt), mask=io)


@triton.jit
def _stream(KIND: tl.constexpr, pid, P, a_ptr, nw_ptr, w_ptr, part_ptr, cnt_ptr, eps,
            x_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr, skg, skt, svg, svt, spg, spt, out_ptr,
            NT: tl.constexpr, K: tl.constexpr, NCOL: tl.constexpr, OFFB: tl.constexpr, TWO: tl.constexpr,
            NORM: tl.constexpr, T: tl.constexpr, E: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
            D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MAXP: tl.constexpr,
            HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
            KS: tl.constexpr):
    """A projection stage of NT tiles of BN output columns, each reduced over K in KC chunks of BK:
    the NT * KC units split evenly over the P programs (stream-K), program pid taking units
    [pid * U // P, (pid + 1) * U // P) in one software-pipelined loop, so its loads run ahead across
    tile boundaries and every program moves the same bytes. The loop only stores each tile's float32
    sums to the program's slots (MAXP of them: loads or atomics inside it would stop the pipelining);
    then each tile it touched is joined (_tile_sums) and finished by one program (_tile_out)."""
    KC: tl.constexpr = (K + BK - 1) // BK
    U: tl.constexpr = NT * KC
    u0 = pid * U // P
    u1 = (pid + 1) * U // P
    offs_t = tl.arange(0, BT)
    t_ok = offs_t < T
    if NORM:
        rstd = _rstd(a_ptr, eps, offs_t, t_ok, E, BT, BK)  # once per program: x is the stage's input
    else:
        rstd = tl.zeros([BT], tl.float32)
    acc_a = tl.zeros([BT, BN], tl.float32)
    acc_b = tl.zeros([BT, BN], tl.float32)
    # two loops, as prefix_split's: the interpreter's scalars cannot bound a range()
    if INTERPRET:
        u = u0
        while u < u1:
            acc_a, acc_b = _step(u, u0, u1, pid, acc_a, acc_b, KIND, a_ptr, nw_ptr, rstd, w_ptr, part_ptr, offs_t,
                                 t_ok, KC, K, NCOL, OFFB, TWO, NORM, D, BT, BN, BK, MAXP, IEEE)
            u += 1
    else:
        for u in tl.range(u0, u1, num_stages=KS):  # KS units' weights in flight
            acc_a, acc_b = _step(u, u0, u1, pid, acc_a, acc_b, KIND, a_ptr, nw_ptr, rstd, w_ptr, part_ptr, offs_t,
                                 t_ok, KC, K, NCOL, OFFB, TWO, NORM, D, BT, BN, BK, MAXP, IEEE)
    tl.debug_barrier()  # every thread's partials written (and released below by the counters' atomics)
    t = u0 // KC
    t_last = tl.where(u1 > u0, (u1 - 1) // KC, t - 1)  # none when the program has no units
    while t <= t_last:
        acc_a, acc_b, ready = _tile_sums(t, u0, u1, pid, P, part_ptr, cnt_ptr, U, KC, MAXP, BT, BN, TWO)
        if ready:
            _tile_out(KIND, t, acc_a, acc_b, x_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr,
                      skg, skt, svg, svt, spg, spt, out_ptr, offs_t, t_ok, NCOL, T, H, G, D, BN, HAS_BIAS, STORE_PRE)
        t += 1


@triton.jit
def _step(u, u0, u1, pid, acc_a, acc_b, KIND: tl.constexpr, a_ptr, nw_ptr, rstd, w_ptr, part_ptr, offs_t, t_ok,
          KC: tl.constexpr, K: tl.constexpr, NCOL: tl.constexpr, OFFB: tl.constexpr, TWO: tl.constexpr,
          NORM: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          MAXP: tl.constexpr, IEEE: tl.constexpr):
    """_stream's loop body: unit u; if it ends this program's part of its tile, the part's sums go to
    the program's slot for that tile and the accumulators start again."""
    acc_a, acc_b = _unit(u, acc_a, acc_b, KIND, a_ptr, nw_ptr, rstd, w_ptr, offs_t, t_ok,
                         K, KC, NCOL, OFFB, D, BN, BK, TWO, NORM, IEEE)
    if (u % KC == KC - 1) | (u == u1 - 1):
        offs = tl.arange(0, BT)[:, None] * BN + tl.arange(0, BN)[None, :]  # [BT, BN]
        sl = part_ptr + (pid * MAXP + u // KC - u0 // KC) * (2 * BT * BN)
        tl.store(sl + offs, acc_a)
        if TWO:
            tl.store(sl + BT * BN + offs, acc_b)
        acc_a = tl.zeros([BT, BN], tl.float32)
        acc_b = tl.zeros([BT, BN], tl.float32)
    return acc_a, acc_b


@triton.jit
def layer_kernel(x_ptr, nw1_ptr, wqkv_ptr, bqkv_ptr, cos_ptr, sin_ptr, q_ptr,
                 k_ptr, v_ptr, kp_ptr, skg, skt, svg, svt, spg, spt,
                 kv_ptr, meta_ptr, layer, outp_ptr, lsep_ptr,
                 kt_ptr, vt_ptr, stg, stn, svtg, svtn, bias_ptr, attn_ptr, lse_ptr,
                 wo_ptr, nw2_ptr, wgu_ptr, act_ptr, wd_ptr, sync_ptr, part_ptr, cnt_ptr, eps, scale_log2,
                 T: tl.constexpr, E: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, I: tl.constexpr, N: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                 BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MAXP: tl.constexpr,
                 PBM: tl.constexpr, PBN: tl.constexpr, MIN_CHUNK: tl.constexpr,
                 CBM: tl.constexpr, CBN: tl.constexpr, DC: tl.constexpr, SB: tl.constexpr,
                 HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr, NEED_LSE: tl.constexpr,
                 IEEE: tl.constexpr, INTERPRET: tl.constexpr, STAGE: tl.constexpr, KS: tl.constexpr):
    """One decoder layer (see the module docstring); shapes and layouts as persistent.run_layer's."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    R: tl.constexpr = H // G
    M: tl.constexpr = R * T
    N1: tl.constexpr = (H + 2 * G) * ((D // 2 + BN - 1) // BN)
    MB2: tl.constexpr = (M + PBM - 1) // PBM
    N2: tl.constexpr = MB2 * S * G
    C3: tl.constexpr = (D + DC - 1) // DC
    N3: tl.constexpr = ((M + CBM - 1) // CBM) * G * C3
    N4: tl.constexpr = (E + BN - 1) // BN
    N5: tl.constexpr = (I + BN - 1) // BN
    ALL: tl.constexpr = STAGE < 0
    if ALL or STAGE == 1:
        _stream(QKV, pid, P, x_ptr, nw1_ptr, wqkv_ptr, part_ptr, cnt_ptr, eps, x_ptr, bqkv_ptr, cos_ptr, sin_ptr,
                q_ptr, k_ptr, v_ptr, kp_ptr, skg, skt, svg, svt, spg, spt, attn_ptr, N1, E, (H + 2 * G) * D,
                D // 2, True, True, T, E, H, G, D, BT, BN, BK, MAXP, HAS_BIAS, STORE_PRE, IEEE, INTERPRET, KS)
    if ALL:
        _grid_sync(sync_ptr, P)
    if ALL or STAGE == 2:
        it = pid
        while it < N2:
            prefix_split(q_ptr, kv_ptr, meta_ptr, outp_ptr, lsep_ptr, scale_log2, layer, M,
                         it // (S * G), (it // G) % S, it % G, G, D, DP, S, PBM, PBN, MIN_CHUNK, IEEE, INTERPRET)
            it += P
    if ALL:
        _grid_sync(sync_ptr, 2 * P)
    if ALL or STAGE == 3:
        it = pid
        while it < N3:
            combine_block(q_ptr, kt_ptr, vt_ptr, bias_ptr, outp_ptr, lsep_ptr, attn_ptr, lse_ptr, scale_log2,
                          stg, stn, svtg, svtn, it // (G * C3), (it // C3) % G, it % C3, G,
                          T, R, N, S, SP, D, DP, DC, CBM, CBN, SB, NEED_LSE, IEEE, INTERPRET)
            it += P
    if ALL:
        _grid_sync(sync_ptr, 3 * P)
    if ALL or STAGE == 4:
        _stream(LINRES, pid, P, attn_ptr, nw2_ptr, wo_ptr, part_ptr, cnt_ptr, eps, x_ptr, bqkv_ptr, cos_ptr,
                sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr, skg, skt, svg, svt, spg, spt, x_ptr, N4, H * D, E, 0,
                False, False, T, E, H, G, D, BT, BN, BK, MAXP, HAS_BIAS, STORE_PRE, IEEE, INTERPRET, KS)
    if ALL:
        _grid_sync(sync_ptr, 4 * P)
    if ALL or STAGE == 5:
        _stream(GLU, pid, P, x_ptr, nw2_ptr, wgu_ptr, part_ptr, cnt_ptr, eps, x_ptr, bqkv_ptr, cos_ptr, sin_ptr,
                q_ptr, k_ptr, v_ptr, kp_ptr, skg, skt, svg, svt, spg, spt, act_ptr, N5, E, I, I,
                True, True, T, E, H, G, D, BT, BN, BK, MAXP, HAS_BIAS, STORE_PRE, IEEE, INTERPRET, KS)
    if ALL:
        _grid_sync(sync_ptr, 5 * P)
    if ALL or STAGE == 6:
        _stream(LINRES, pid, P, act_ptr, nw2_ptr, wd_ptr, part_ptr, cnt_ptr, eps, x_ptr, bqkv_ptr, cos_ptr,
                sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr, skg, skt, svg, svt, spg, spt, x_ptr, N4, I, E, 0,
                False, False, T, E, H, G, D, BT, BN, BK, MAXP, HAS_BIAS, STORE_PRE, IEEE, INTERPRET, KS)
