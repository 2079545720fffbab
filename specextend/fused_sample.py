"""Sampling a row of logits in two Triton kernels instead of some fifteen PyTorch ops
(docs/architecture.md, "Kernels": *Fused sampling*).

sampling.sample_rows' PyTorch path (max, shift, divide, softmax, a float64 cumulative sum over the
vocabulary, a search) cost 0.26 ms of device time for one row and 0.38 ms for nine on an H200
(2026-11-30), against a greedy step's ~2 ms: a sampled plain step paid ~0.6 ms over a greedy one.
Here one program per (row, block of 4096 columns) reads its block once for its max and its sum of
exp((x - max) / temperature); one program per row then finds the block where u * total falls and,
reading that block again, the column. Top-k drops the columns below the row's k-th largest logit
(torch.topk gives it, one op); top-p keeps the PyTorch path (it sorts: a kept set is not a
threshold found in one pass).

Twin: sampling.search(target_probs(logits.float(), params), u) (the tests compare them, on the CPU
in Triton's interpreter): the same token except where u * total lands within rounding of a step of
the CDF (the kernels sum in another order; the twin's probabilities are float32, rounded before
their float64 sum).
"""

from __future__ import annotations

import torch

from specextend.attention.triton_prefix import TRITON_DTYPES, triton_available
from specextend.config import SamplingParams

BLOCK = 4096  # columns per program: 38 blocks a row for a 152K vocabulary


def takes(params: SamplingParams) -> bool:
    """Whether the kernels sample with these parameters (no top-p), where Triton imports."""
    return params.top_p >= 1.0 and triton_available()


def supported(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Rows of a CUDA tensor in a dtype the kernels take, and parameters they take."""
    return (logits.is_cuda and logits.dim() == 2 and logits.dtype in TRITON_DTYPES and logits.stride(-1) == 1
            and takes(params))


def fused_sample(logits: torch.Tensor,  # [R, V], last dim contiguous
                 params: SamplingParams, u: torch.Tensor,  # [R] float64 on the logits' device
                 block: int = BLOCK) -> torch.Tensor:
    """-> [R] int64: row r's inverse-CDF sample of softmax(logits / temperature) (top-k applied)
    with the uniform u[r]."""
    from specextend._triton_sample import block_stats, pick

    r, v = logits.shape
    assert logits.stride(-1) == 1 and block & (block - 1) == 0 and params.top_p >= 1.0
    block = min(block, 1 << (v - 1).bit_length())
    nb = -(-v // block)
    has_floor = 0 < params.top_k < v
    floor = (torch.topk(logits, params.top_k, dim=-1).values[:, -1].float().contiguous() if has_floor
             else u)  # [R] the k-th largest logit (unused without top-k)
    stat = torch.empty(r, nb, 2, dtype=torch.float32, device=logits.device)  # [R, NB, (max, sum exp)]
    out = torch.empty(r, dtype=torch.int64, device=logits.device)  # [R]
    t = float(params.temperature)
    warps = 8 if block >= 4096 else 4
    block_stats[(r, nb)](logits, logits.stride(0), floor, stat, t, V=v, NB=nb, BLOCK=block,
                         HAS_FLOOR=has_floor, num_warps=warps)
    pick[(r,)](logits, logits.stride(0), floor, stat, u.contiguous(), out, t, V=v, NB=nb,
               NBP=1 << max(0, (nb - 1).bit_length()), BLOCK=block, HAS_FLOOR=has_floor, num_warps=warps)
    return out
