"""Triton kernels of fused_sample.py (imported lazily: Triton is optional; with TRITON_INTERPRET=1 set
before Triton is first imported they run in Triton's CPU interpreter)."""

import triton
import triton.language as tl


@triton.jit
def _scaled(x, m, temperature):
    """(x - m) / temperature, 0 where x == m (a temperature below float32's range divides 0 by 0
    there; sampling.target_probs' convention), -inf where x is -inf."""
    return tl.where(x == m, 0.0, (x - m) / temperature)


@triton.jit
def block_stats(logits_ptr, row_stride, floor_ptr, stat_ptr, temperature,
                V: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """Program (row r, block b) of logits [R, V]: the block's max m and sum of
    exp((x - m) / temperature) over its columns at or above the row's floor (top-k: floor [R]
    float32, its k-th largest logit), into stat [R, NB, 2] float32 (max -inf and sum 0 where
    nothing is left)."""
    r = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    x = tl.load(logits_ptr + r * row_stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if HAS_FLOOR:
        x = tl.where(x >= tl.load(floor_ptr + r), x, float("-inf"))
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(_scaled(x, m, temperature)), 0)
    s = tl.where(m == float("-inf"), 0.0, s)  # (a block of -inf scales to 0 there: exp(0) each)
    tl.store(stat_ptr + (r * NB + b) * 2, m)
    tl.store(stat_ptr + (r * NB + b) * 2 + 1, s)


@triton.jit
def pick(logits_ptr, row_stride, floor_ptr, stat_ptr, u_ptr, out_ptr, temperature,
         V: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, BLOCK: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """Program r: the inverse-CDF sample of row r with the uniform u[r] (float64), into out [R]
    int64. The blocks' weights (their sums rescaled to the row's max) in float64 give the block
    where u * total falls, then that block's columns, cumulated in float64, the first column whose
    running sum reaches it; never past the block's last column of nonzero weight (rounding), and 0
    where u is 0 (as sampling.search)."""
    r = tl.program_id(0)
    nb = tl.arange(0, NBP)
    ok = nb < NB
    m_b = tl.load(stat_ptr + (r * NB + nb) * 2, mask=ok, other=float("-inf"))  # [NBP]
    s_b = tl.load(stat_ptr + (r * NB + nb) * 2 + 1, mask=ok, other=0.0)
    m = tl.max(m_b, 0)
    w = tl.where(m_b == float("-inf"), 0.0, s_b * tl.exp(_scaled(m_b, m, temperature))).to(tl.float64)  # [NBP]
    cum = tl.cumsum(w, 0)  # [NBP] inclusive
    target = tl.load(u_ptr + r) * tl.max(cum, 0)
    b = tl.minimum(tl.sum((cum < target).to(tl.int32), 0), NB - 1)
    before = tl.sum(tl.where(nb == b, cum - w, 0.0), 0)  # the blocks before b
    cols = tl.arange(0, BLOCK)
    offs = b * BLOCK + cols  # [BLOCK]
    x = tl.load(logits_ptr + r * row_stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if HAS_FLOOR:
        x = tl.where(x >= tl.load(floor_ptr + r), x, float("-inf"))
    e = tl.exp(_scaled(x, m, temperature))  # [BLOCK] float32, 0 at -inf
    e = tl.where(x == float("-inf"), 0.0, e)
    run = before + tl.cumsum(e.to(tl.float64), 0)  # [BLOCK]
    j = tl.sum((run < target).to(tl.int32), 0)
    last = tl.max(tl.where(e > 0, cols, -1), 0)  # the block's last column of nonzero weight
    j = tl.where(last >= 0, tl.minimum(j, last), 0)
    tl.store(out_ptr + r, (b * BLOCK + j).to(tl.int64))
