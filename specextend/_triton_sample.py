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
def _row(logits_ptr, row_stride, floor_ptr, r, offs, V: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """Row r's logits at `offs` as float32, -inf past V and (top-k, top-p) below the row's floor."""
    x = tl.load(logits_ptr + r * row_stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if HAS_FLOOR:
        x = tl.where(x >= tl.load(floor_ptr + r), x, float("-inf"))
    return x


@triton.jit
def _weight(x, m, temperature):
    """exp((x - m) / temperature), 0 where x is -inf (also where m is: a block with nothing left)."""
    return tl.where(x == float("-inf"), 0.0, tl.exp(_scaled(x, m, temperature)))


@triton.jit
def block_stats(logits_ptr, row_stride, floor_ptr, stat_ptr, temperature,
                V: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """Program (row r, block b) of logits [R, V]: the block's max m and sum of
    exp((x - m) / temperature) over its columns at or above the row's floor (top-k: floor [R]
    float32, its k-th largest logit), into stat [R, NB, 2] float32 (max -inf and sum 0 where
    nothing is left)."""
    r = tl.program_id(0)
    b = tl.program_id(1)
    x = _row(logits_ptr, row_stride, floor_ptr, r, b * BLOCK + tl.arange(0, BLOCK), V, HAS_FLOOR)  # [BLOCK]
    m = tl.max(x, 0)
    s = tl.sum(_weight(x, m, temperature), 0)
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
    x = _row(logits_ptr, row_stride, floor_ptr, r, b * BLOCK + cols, V, HAS_FLOOR)  # [BLOCK]
    e = _weight(x, m, temperature)  # [BLOCK] float32
    run = before + tl.cumsum(e.to(tl.float64), 0)  # [BLOCK]
    j = tl.sum((run < target).to(tl.int32), 0)
    last = tl.max(tl.where(e > 0, cols, -1), 0)  # the block's last column of nonzero weight
    j = tl.where(last >= 0, tl.minimum(j, last), 0)
    tl.store(out_ptr + r, (b * BLOCK + j).to(tl.int64))


@triton.jit
def _key(x):
    """float32 -> int64 in [0, 2**32), ordered as the floats (a monotone radix key)."""
    b = x.to(tl.int32, bitcast=True)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)  # negative floats: their magnitude bits flipped (signed order)
    return k.to(tl.int64) + 2147483648


@triton.jit
def mass_hist(logits_ptr, row_stride, floor_ptr, stat_ptr, pref_ptr, hist_ptr, temperature, shift,
              V: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, BLOCK: tl.constexpr, CH: tl.constexpr,
              HAS_FLOOR: tl.constexpr):
    """Program (row r, block b), one pass of top-p's radix select: the probability mass (unnormalised,
    exp((x - max) / T)) of the block's columns whose key agrees with the row's prefix pref[r] above
    bit shift + 8, by their key's 8 bits from `shift`, into hist [R, NB, 256] float32."""
    r = tl.program_id(0)
    b = tl.program_id(1)
    nb = tl.arange(0, NBP)
    m = tl.max(tl.load(stat_ptr + (r * NB + nb) * 2, mask=nb < NB, other=float("-inf")), 0)  # the row's max
    pref = tl.load(pref_ptr + r) >> (shift + 8)
    bins = tl.arange(0, 256)
    acc = tl.zeros([256], dtype=tl.float32)
    for c in range(0, BLOCK, CH):
        x = _row(logits_ptr, row_stride, floor_ptr, r, b * BLOCK + c + tl.arange(0, CH), V, HAS_FLOOR)  # [CH]
        e = _weight(x, m, temperature)
        key = _key(x)
        e = tl.where((key >> (shift + 8)) == pref, e, 0.0)
        digit = ((key >> shift) & 255).to(tl.int32)
        acc += tl.sum(tl.where(digit[:, None] == bins[None, :], e[:, None], 0.0), 0)  # [256]
    tl.store(hist_ptr + (r * NB + b) * 256 + bins, acc)


@triton.jit
def mass_select(hist_ptr, pref_ptr, mass_ptr, floor_ptr, top_p, shift,
                NB: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr):
    """Program r, one pass of top-p's radix select: the lowest bucket of mass whose columns have less
    than top_p of the row's mass strictly above them (mass [R, 2] float64: above the prefix, and
    top_p times the total, set on the first pass) joins the prefix pref [R] int64; on the last pass
    the prefix is the kept set's smallest key, written to floor [R] as its float32."""
    r = tl.program_id(0)
    bins = tl.arange(0, 256)
    h = tl.zeros([256], dtype=tl.float64)  # the buckets' mass, blocks summed in order
    for i in tl.static_range(NB):
        h += tl.load(hist_ptr + (r * NB + i) * 256 + bins).to(tl.float64)
    pref = tl.load(pref_ptr + r)  # (0 before the first pass)
    if FIRST:
        above0 = tl.sum(h, 0) * 0.0
        cut = top_p * tl.sum(h, 0)
    else:
        above0 = tl.load(mass_ptr + r * 2)
        cut = tl.load(mass_ptr + r * 2 + 1)
    above = above0 + (tl.cumsum(h, 0, reverse=True) - h)  # [256] mass strictly above each bucket
    j = tl.min(tl.where((h > 0) & (above < cut), bins, 256), 0)
    j = tl.minimum(j, 255)
    tl.store(mass_ptr + r * 2, tl.sum(tl.where(bins == j, above, 0.0), 0))
    tl.store(mass_ptr + r * 2 + 1, cut)
    pref = pref | (j.to(tl.int64) << shift)
    tl.store(pref_ptr + r, pref)
    if LAST:
        k = (pref - 2147483648).to(tl.int32)
        b = k ^ ((k >> 31) & 0x7FFFFFFF)  # _key's inverse
        tl.store(floor_ptr + r, b.to(tl.float32, bitcast=True))
