"""The draft's `w` most likely next tokens per row and their log-probabilities, over the whole
vocabulary, in two Triton kernels (docs/architecture.md, "Kernels").

Every draft forward ends with this: a tree level's children, a background forward's pool children.
PyTorch spends three kernels on it, and torch.topk's radix select over a 152K vocabulary is the
slow one: 60 us a call for 4-8 rows of the 0.5B draft on an H100 (2026-11-26, profile_step.py),
with the log-sum-exp 22 us, against 97 us for the lm_head GEMM that produced the logits.
Here each program reads one block of one row once: its max and sum of exponentials (the row's
log-sum-exp, merged later) and its `w` best columns by repeated argmax; a second kernel merges the
blocks of each row. Ties go to the lowest token id (torch.topk leaves their order unspecified).

Twin: expand.top_logprobs' torch path (the tests compare them, on the CPU in Triton's
interpreter): the same values and ids where no two logits tie, log-probabilities within float32
rounding of the log-sum-exp.
"""

from __future__ import annotations

import torch

from specextend.attention.triton_prefix import TRITON_DTYPES, triton_available

BLOCK = 4096  # columns per program: 38 blocks a row for a 152K vocabulary
MAX_W = 16  # widest top-k taken here (repeated argmax costs w passes over a block)


def supported(logits: torch.Tensor, w: int) -> bool:
    """Rows of a CUDA tensor in a dtype the kernels take, w up to MAX_W, Triton importable."""
    return (logits.is_cuda and logits.dim() == 2 and logits.dtype in TRITON_DTYPES and 1 <= w <= MAX_W
            and logits.stride(-1) == 1 and w <= logits.shape[1] and triton_available())


def vocab_topk(logits: torch.Tensor,  # [R, V], last dim contiguous
               w: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (log-probabilities [R, w] float32, token ids [R, w] int64), best first."""
    from specextend.draft._triton_topk import block_topk, merge_topk

    r, v = logits.shape
    assert logits.stride(-1) == 1 and block & (block - 1) == 0
    block = min(block, 1 << (v - 1).bit_length())
    nb = -(-v // block)
    dev = logits.device
    cand_v = torch.empty(r, nb, w, dtype=torch.float32, device=dev)  # [R, NB, w]
    cand_i = torch.empty(r, nb, w, dtype=torch.int32, device=dev)
    stat = torch.empty(r, nb, 2, dtype=torch.float32, device=dev)  # [R, NB, (max, sum exp)]
    out_v = torch.empty(r, w, dtype=torch.float32, device=dev)
    out_i = torch.empty(r, w, dtype=torch.int64, device=dev)
    block_topk[(r, nb)](logits, logits.stride(0), cand_v, cand_i, stat, V=v, NB=nb, W=w, BLOCK=block,
                        num_warps=8 if block >= 4096 else 4)
    merge_topk[(r,)](cand_v, cand_i, stat, out_v, out_i, NB=nb, NBP=1 << max(0, (nb - 1).bit_length()),
                     W=w, CP=1 << (nb * w - 1).bit_length(), num_warps=1)
    return out_v, out_i
