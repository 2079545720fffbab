"""Sampling a row of logits in Triton kernels instead of some fifteen PyTorch ops
(docs/architecture.md, "Kernels": *Fused sampling*).

sampling.sample_rows' PyTorch path (max, shift, divide, softmax, a float64 cumulative sum over the
vocabulary, a search; with top-p a sort of the vocabulary) cost 0.26 ms of device time for one row
and 0.38 ms for nine on an H200 (2026-11-30), against a greedy step's ~2 ms. Here one program per
(row, block of 4096 columns) reads its block once for its max and its sum of
exp((x - max) / temperature); one program per row then finds the block where u * total falls and,
reading that block again, the column. Top-k drops the columns below the row's k-th largest logit
(torch.topk gives it, one op). Top-p drops those below the smallest logit it keeps, found by a
radix select on the logits' bits weighted by their mass (`top_p_floor`: four passes of two
kernels), so that nothing is sorted.

Twin: sampling.search(target_probs(logits.float(), params), u) (the tests compare them, on the CPU
in Triton's interpreter): the same token except where u * total lands within rounding of a step of
the CDF (the kernels sum in another order; the twin's probabilities are float32, rounded before
their float64 sum), or where top-p's running mass lands within rounding of top_p. Both keep every
token tied with the least likely one top-p keeps.
"""

from __future__ import annotations

import torch

from specextend.attention.triton_prefix import TRITON_DTYPES, triton_available
from specextend.config import SamplingParams

BLOCK = 4096  # columns per program: 38 blocks a row for a 152K vocabulary
# top-p through the kernels (top_p_floor): built and tested, the same samples as the PyTorch path on
# an H200, but 1.0-3.1 ms for 1-17 rows against the sort's 0.14-0.57 (its one-hot histograms are
# compute; 2026-11-30), so off: top-p takes the PyTorch path, whose ties it keeps as the kernels do
TOP_P_KERNELS = False


def takes(params: SamplingParams) -> bool:
    """Whether the kernels sample with these parameters (temperature and top-k; top-p where
    TOP_P_KERNELS), where Triton imports."""
    return (params.top_p >= 1.0 or TOP_P_KERNELS) and triton_available()


def runs_cheaply(params: SamplingParams) -> bool:
    """Whether a lookup run's rows sample through the kernels at the cost measured for runs
    (temperature and top-k; top-p's radix select, eight launches more, was not measured in runs)."""
    return params.top_p >= 1.0 and takes(params)


def supported(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Rows of a CUDA tensor in a dtype the kernels take, Triton importable."""
    return (logits.is_cuda and logits.dim() == 2 and logits.dtype in TRITON_DTYPES and logits.stride(-1) == 1
            and takes(params))


def fused_sample(logits: torch.Tensor,  # [R, V], last dim contiguous
                 params: SamplingParams, u: torch.Tensor,  # [R] float64 on the logits' device
                 block: int = BLOCK) -> torch.Tensor:
    """-> [R] int64: row r's inverse-CDF sample of softmax(logits / temperature) (top-k and top-p
    applied) with the uniform u[r]."""
    from triton import next_power_of_2

    from specextend._triton_sample import block_stats, pick

    r, v = logits.shape
    assert logits.stride(-1) == 1 and block & (block - 1) == 0
    block = min(block, 1 << (v - 1).bit_length())
    nb = -(-v // block)
    nbp = next_power_of_2(nb)
    has_floor = 0 < params.top_k < v
    floor = (torch.topk(logits, params.top_k, dim=-1).values[:, -1].float().contiguous() if has_floor
             else u)  # [R] the k-th largest logit (unused without top-k)
    stat = torch.empty(r, nb, 2, dtype=torch.float32, device=logits.device)  # [R, NB, (max, sum exp)]
    out = torch.empty(r, dtype=torch.int64, device=logits.device)  # [R]
    t = float(params.temperature)
    warps = 8 if block >= 4096 else 4
    block_stats[(r, nb)](logits, logits.stride(0), floor, stat, t, V=v, NB=nb, BLOCK=block,
                         HAS_FLOOR=has_floor, num_warps=warps)
    if params.top_p < 1.0:  # the kept set's smallest logit becomes the floor; the stats again above it
        floor, has_floor = top_p_floor(logits, params, floor, has_floor, stat, block), True
        block_stats[(r, nb)](logits, logits.stride(0), floor, stat, t, V=v, NB=nb, BLOCK=block,
                             HAS_FLOOR=True, num_warps=warps)
    pick[(r,)](logits, logits.stride(0), floor, stat, u.contiguous(), out, t, V=v, NB=nb,
               NBP=nbp, BLOCK=block, HAS_FLOOR=has_floor, num_warps=warps)
    return out


def top_p_floor(logits: torch.Tensor, params: SamplingParams, floor: torch.Tensor, has_floor: bool,
                stat: torch.Tensor,  # [R, NB, 2] block_stats' of the same floor
                block: int) -> torch.Tensor:
    """-> [R] float32: each row's smallest logit that top-p keeps (the most likely columns, fewest
    first, until they hold top_p of the mass; every column tied with the last one kept too), over
    the columns at or above `floor` where `has_floor` (top-k). A radix select on the logits' 32
    bits, 8 a pass: each pass sums the mass of the columns that agree with the prefix so far by
    their next 8 bits (one program per row and block, `mass_hist`) and keeps, per row, the lowest
    bucket whose columns have less than top_p of the mass above them (`mass_select`). The sums
    are in a fixed order: the same logits give the same floor."""
    from triton import next_power_of_2

    from specextend._triton_sample import mass_hist, mass_select

    r, v = logits.shape
    nb = stat.shape[1]
    dev = logits.device
    pref = torch.zeros(r, dtype=torch.int64, device=dev)  # [R] the key's bits chosen so far
    mass = torch.empty(r, 2, dtype=torch.float64, device=dev)  # [R, (mass above the prefix, top_p * total)]
    hist = torch.empty(r, nb, 256, dtype=torch.float32, device=dev)  # [R, NB, 256]
    out = torch.empty(r, dtype=torch.float32, device=dev)  # [R]
    t = float(params.temperature)
    for i, shift in enumerate((24, 16, 8, 0)):
        mass_hist[(r, nb)](logits, logits.stride(0), floor, stat, pref, hist, t, shift, V=v, NB=nb,
                           NBP=next_power_of_2(nb), BLOCK=block, CH=min(64, block), HAS_FLOOR=has_floor, num_warps=4)
        mass_select[(r,)](hist, pref, mass, out, float(params.top_p), shift, NB=nb,
                          FIRST=i == 0, LAST=shift == 0, num_warps=4)
    return out
