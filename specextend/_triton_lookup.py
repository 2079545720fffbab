"""Triton kernels of a lookup run's step (lookup_device.py; imported lazily: Triton is optional; with
TRITON_INTERPRET=1 set before Triton is first imported they run in Triton's CPU interpreter).

Three launches a step instead of some forty small torch ops (about 0.25 ms of device time a step at
16K on an H200, 2026-11-29, benchmarks/lookup_ahead_parts.py): `match_orders` (the latest earlier
start of the last 3-, 2- and 1-gram, one program per block of the history, atomically maxed),
`chain_ids` (the longest order's chain and the step's input ids), `chain_verdict` (after the
target's argmax: the accepted count, the history and its length advanced, the packed result).
Their twins are lookup_device.device_match and accepted (tests/test_lookup_ahead.py)."""

import triton
import triton.language as tl


@triton.jit
def match_orders(hist_ptr, length_ptr, best_ptr, C, BLOCK: tl.constexpr):
    """Program b: over starts s in its block of hist [C] (int64, the first length[0] valid), the
    latest s where hist[s:s + n] equals the last n tokens and s <= length - n - 1, for n = 3, 2, 1,
    atomically maxed into best [3] (int32, -1 before the first program: chain_ids resets it)."""
    L = tl.load(length_ptr).to(tl.int32)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    t0 = tl.load(hist_ptr + tl.maximum(L - 3, 0))
    t1 = tl.load(hist_ptr + tl.maximum(L - 2, 0))
    t2 = tl.load(hist_ptr + tl.maximum(L - 1, 0))
    h0 = tl.load(hist_ptr + offs, mask=offs < C, other=-1)  # tokens are >= 0: -1 matches none
    h1 = tl.load(hist_ptr + offs + 1, mask=offs + 1 < C, other=-1)
    h2 = tl.load(hist_ptr + offs + 2, mask=offs + 2 < C, other=-1)
    m3 = (h0 == t0) & (h1 == t1) & (h2 == t2) & (offs <= L - 4) & (L > 3)
    m2 = (h0 == t1) & (h1 == t2) & (offs <= L - 3) & (L > 2)
    m1 = (h0 == t2) & (offs <= L - 2) & (L > 1)
    tl.atomic_max(best_ptr, tl.max(tl.where(m3, offs, -1), 0))
    tl.atomic_max(best_ptr + 1, tl.max(tl.where(m2, offs, -1), 0))
    tl.atomic_max(best_ptr + 2, tl.max(tl.where(m1, offs, -1), 0))


@triton.jit
def chain_ids(hist_ptr, length_ptr, best_ptr, ids_ptr, count_ptr, C, Q: tl.constexpr, QP: tl.constexpr):
    """One program: the chain after the longest order's start (up to Q tokens before length) into
    ids [Q + 1] after the root (hist[length - 1]), its count into count [1] (int64; 0: none); best
    reset to -1 for the next step."""
    L = tl.load(length_ptr)
    b3 = tl.load(best_ptr)
    b2 = tl.load(best_ptr + 1)
    b1 = tl.load(best_ptr + 2)
    first = tl.where(b3 >= 0, b3 + 3, tl.where(b2 >= 0, b2 + 2, tl.where(b1 >= 0, b1 + 1, -1))).to(tl.int64)
    cnt = tl.where(first >= 0, tl.minimum(tl.maximum(L - first, 0), Q), 0)
    j = tl.arange(0, QP)
    src = tl.minimum(tl.maximum(first, 0) + j, C - 1)
    chain = tl.load(hist_ptr + src, mask=j < Q, other=0)
    tl.store(ids_ptr + 1 + j, chain, mask=j < Q)
    tl.store(ids_ptr, tl.load(hist_ptr + L - 1))
    tl.store(count_ptr, cnt)
    k = tl.arange(0, 4)
    tl.store(best_ptr + k, tl.full((4,), -1, tl.int32), mask=k < 3)


@triton.jit
def chain_verdict(y_ptr, ids_ptr, count_ptr, hist_ptr, length_ptr, packed_ptr, Q: tl.constexpr, QP: tl.constexpr):
    """One program, after y [Q + 1] = the target's argmax after each row of ids: n, the leading chain
    tokens (ids[1:], the first count real) that y confirms; y written at hist[length:], length
    advanced by n + 1; packed [Q + 3] = (n, count, y) for the host."""
    j = tl.arange(0, QP)  # QP > Q: rows 0..Q
    y = tl.load(y_ptr + j, mask=j <= Q, other=-1)
    chain = tl.load(ids_ptr + 1 + j, mask=j < Q, other=-2)
    cnt = tl.load(count_ptr)
    ok = (y == chain) & (j < cnt)
    n = tl.min(tl.where(ok, QP, j), 0).to(tl.int64)  # the first row that fails (<= count)
    L = tl.load(length_ptr)
    tl.store(hist_ptr + L + j, y, mask=j <= Q)
    tl.store(length_ptr, L + n + 1)
    tl.store(packed_ptr, n)
    tl.store(packed_ptr + 1, cnt)
    tl.store(packed_ptr + 2 + j, y, mask=j <= Q)
