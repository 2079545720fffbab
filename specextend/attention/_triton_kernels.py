"""Triton kernels of triton_prefix.py (imported lazily: Triton is optional; with TRITON_INTERPRET=1
set before Triton is first imported they run in Triton's CPU interpreter)."""

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton.jit below, at import


@triton.jit
def key_block(q, k_ptr, v_ptr, n0, end, offs_d, m_i, l_i, acc, scale_log2,
              D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) [BM], [BM], [BM, DP] by keys [n0, n0 + BN) < end;
    offs_d [DP]: head dims padded to a power of two (masked past D)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN]
    key_ok = offs_n < end
    ld = key_ok[:, None] & (offs_d < D)[None, :]  # [BN, DP]
    k = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :], mask=ld, other=0.0)
    v = tl.load(v_ptr + offs_n[:, None] * D + offs_d[None, :], mask=ld, other=0.0)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = tl.where(key_ok[None, :], qk * scale_log2, float("-inf"))  # [BM, BN] in log2 units
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["layer", "M", "T", "NB", "SPLITS"])
def prefix_partials(q_ptr, kv_ptr, meta_ptr, out_ptr, lse_ptr, scale_log2, layer, M, T, NB, SPLITS,
                    G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, IEEE: tl.constexpr,
                    INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # nothing to load before the wait: PDL hides the launch gap (specextend/pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    bg = tl.program_id(2)  # session * G + KV head
    prefix_split(q_ptr, kv_ptr, meta_ptr, out_ptr, lse_ptr, scale_log2, layer, M,
                 tl.program_id(0), tl.program_id(1), bg % G, bg // G, T, NB, SPLITS,
                 G, D, DP, BLOCK_M, BLOCK_N, MIN_CHUNK, IEEE, INTERPRET)


@triton.jit
def prefix_split(q_ptr, kv_ptr, meta_ptr, out_ptr, lse_ptr, scale_log2, layer, M, mb, s, g, b, T, NB, SPLITS,
                 G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """Row block mb of KV head g over split s of session b's committed keys (prefix_partials' one
    program; also a work item of the persistent layer kernel, models/_triton_persist.py). The M
    folded rows are (query head of the group, session, token) for NB sessions of T tokens each:
    session b owns M // NB of them, and its cache is described by meta[4b:4b + 4]."""
    idx = tl.arange(0, 4)
    mv = tl.load(meta_ptr + b * 4 + idx)  # [4] (offset, L, capacity, unused): scalars by reduction
    # cache.data - kv_ptr in elements, a multiple of 16 (cache_meta): written as // 16 * 16 so that the
    # compiler knows it (tl.multiple_of is lost on a scalar) and loads keys 16 bytes at a time with
    # pipelined async copies; without it they were 2-byte loads, the kernel at ~45% of bandwidth
    off = tl.sum(tl.where(idx == 0, mv, 0), 0) // 16 * 16
    L = tl.sum(tl.where(idx == 1, mv, 0), 0).to(tl.int32)  # an int32 loop: i64 loops are not pipelined
    cap = tl.sum(tl.where(idx == 2, mv, 0), 0)
    kv = kv_ptr + off  # the cache, through an aligned pointer (vectorized loads)
    k_ptr = kv + ((layer * 2 + 0) * G + g) * cap * D  # [cap, D] of layer, head g
    v_ptr = kv + ((layer * 2 + 1) * G + g) * cap * D
    chunk = tl.maximum(tl.cdiv(tl.cdiv(L, SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)  # split_chunk's
    start = s * chunk
    end = tl.minimum(L, start + chunk)
    local = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] this session's folded rows
    row_ok = local < M // NB
    offs_m = (local // T) * (NB * T) + b * T + local % T  # [BM] rows of the batch (= local for one session)
    offs_d = tl.arange(0, DP)  # [DP]
    io = row_ok[:, None] & (offs_d < D)[None, :]  # [BM, DP]
    q = tl.load(q_ptr + (g * M + offs_m)[:, None] * D + offs_d[None, :], mask=io, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    # Online softmax over key blocks. Two loops: the interpreter's scalars cannot bound a range()
    # (numpy 2), and a while loop would not be software-pipelined when compiled.
    if INTERPRET:
        n0 = start
        while n0 < end:
            m_i, l_i, acc = key_block(q, k_ptr, v_ptr, n0, end, offs_d, m_i, l_i, acc, scale_log2, D, BLOCK_N, IEEE)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = key_block(q, k_ptr, v_ptr, n0, end, offs_d, m_i, l_i, acc, scale_log2, D, BLOCK_N, IEEE)
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    row = (g * SPLITS + s) * M + offs_m  # [BM]
    tl.store(out_ptr + row[:, None] * D + offs_d[None, :], out, mask=io)
    tl.store(lse_ptr + row, lse, mask=row_ok)
