"""Triton kernels of vocab_topk.py (imported lazily: Triton is optional; with TRITON_INTERPRET=1 set
before Triton is first imported they run in Triton's CPU interpreter)."""

import triton
import triton.language as tl


@triton.jit
def block_topk(logits_ptr, row_stride, cand_v_ptr, cand_i_ptr, stat_ptr,
               V: tl.constexpr, NB: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row r, block b) of logits [R, V]: the W largest of its BLOCK columns, best first,
    ties to the lowest column, into cand_v/cand_i [R, NB, W] (float32, int32), and the block's max
    and sum of exp(x - max) into stat [R, NB, 2] (float32)."""
    r = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    x = tl.load(logits_ptr + r * row_stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0)  # 0 for a block of -inf
    out = (r * NB + b) * W
    for i in tl.static_range(W):
        j = tl.argmax(x, 0, tie_break_left=True)
        tl.store(cand_v_ptr + out + i, tl.max(x, 0))
        tl.store(cand_i_ptr + out + i, b * BLOCK + j)
        x = tl.where(tl.arange(0, BLOCK) == j, float("-inf"), x)
    tl.store(stat_ptr + (r * NB + b) * 2, m)
    tl.store(stat_ptr + (r * NB + b) * 2 + 1, s)


@triton.jit
def merge_topk(cand_v_ptr, cand_i_ptr, stat_ptr, out_v_ptr, out_i_ptr,
               NB: tl.constexpr, NBP: tl.constexpr, W: tl.constexpr, CP: tl.constexpr):
    """Program r: the row's log-sum-exp from its NB block stats, then its W best candidates (block
    major: among equal values the first is the lowest column) minus it, into out_v [R, W] (float32)
    and out_i [R, W] (int64)."""
    r = tl.program_id(0)
    nb = tl.arange(0, NBP)
    ok = nb < NB
    m_b = tl.load(stat_ptr + (r * NB + nb) * 2, mask=ok, other=float("-inf"))  # [NBP]
    s_b = tl.load(stat_ptr + (r * NB + nb) * 2 + 1, mask=ok, other=0.0)
    m = tl.max(m_b, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse = m_safe + tl.log(tl.sum(tl.where(ok, s_b * tl.exp(m_b - m_safe), 0.0), 0))
    c = tl.arange(0, CP)
    c_ok = c < NB * W
    v = tl.load(cand_v_ptr + r * NB * W + c, mask=c_ok, other=float("-inf"))  # [CP]
    ids = tl.load(cand_i_ptr + r * NB * W + c, mask=c_ok, other=0)
    for i in tl.static_range(W):
        j = tl.argmax(v, 0, tie_break_left=True)
        tl.store(out_v_ptr + r * W + i, tl.max(v, 0) - lse)
        tl.store(out_i_ptr + r * W + i, tl.sum(tl.where(c == j, ids, 0), 0).to(tl.int64))
        v = tl.where(c == j, float("-inf"), v)
