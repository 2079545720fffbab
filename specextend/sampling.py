"""Turning target logits into tokens: greedy, or temperature / top-k / top-p sampling with the
request's own seeded generator. One uniform draw per emitted token, so a speculative run and an
autoregressive run with the same seed consume the generator identically. `next_token` returns a
host int; `next_token_tensor` the same token as a device tensor without waiting for the device
(plain steps ahead, docs/architecture.md: "Plain steps ahead"): `next_token` reads it on the host."""

from __future__ import annotations

import torch

from specextend import fused_sample
from specextend.config import SamplingParams
from specextend.models.transfer import to_device


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed())
    return g


def rewind(generator: torch.Generator, state: torch.Tensor, draws: int) -> None:
    """`generator` as if, from `state`, it had drawn only `draws` float64 uniforms: uniforms drawn
    ahead for every position that may emit (a lookup run's, a sampled tree's rows), fewer used."""
    generator.set_state(state)
    if draws:
        torch.rand((draws,), generator=generator, dtype=torch.float64)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] -> probabilities [R, V] after temperature, top-k and top-p (float32/64).

    Safe at the limits (docs/architecture.md, *Verification*): the logits are shifted so that the
    maximum is 0 before dividing, so a tiny temperature sends the others to -inf (no overflow to
    +inf and NaN); as temperature -> 0 this is the uniform distribution over the argmax ties, i.e.
    greedy. top_p keeps at least the most likely token, however small it is (it may round to 0 in
    the logits' dtype), and every token tied with the least likely one it keeps."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # max 0; a temperature below float32's range
    x = torch.where(shifted == 0, 0.0, shifted / params.temperature)  # divides by 0: 0/0 -> 0, <0 -> -inf
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [R, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p = torch.sort(probs, dim=-1, descending=True).values  # [R, V]
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= params.top_p  # keep the smallest prefix reaching top_p
        drop[..., 0] = False  # ... and the top token always (top_p -> 0 is greedy)
        # ... and every token tied with its last one: the sort orders ties as it likes, so which of
        # them a prefix would keep is arbitrary; all of them is what fused_sample's radix select
        # keeps (the columns whose mass strictly above is under top_p)
        least = sorted_p.masked_fill(drop, float("inf")).amin(-1, keepdim=True)  # [R, 1]
        probs = torch.where(probs >= least, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def next_token(logits_row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits_row [V] -> token id: the host's read of next_token_tensor (one path for every step
    that samples, so that a seed gives the same tokens whichever step emits them)."""
    if params.greedy:
        return int(torch.argmax(logits_row).item())
    return int(next_token_tensor(logits_row, params, generator)[0])


def next_token_tensor(logits_row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """logits_row [V] -> the token of next_token(logits_row, params, generator), as a [1] int64
    tensor on the logits' device, computed without synchronising: the uniform is drawn on the host
    (it does not depend on the logits) and uploaded; the inverse-CDF search runs on the device
    (sample_rows)."""
    if params.greedy:
        return torch.argmax(logits_row).view(1)
    u = to_device(torch.rand((1,), generator=generator, dtype=torch.float64), torch.float64, logits_row.device)  # [1]
    return sample_rows(logits_row[None], params, u)  # [1]


def sample_rows(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """The sampled token of each row of logits [R, V], row r with the uniform u[r] ([R] float64 on
    the logits' device): an inverse-CDF search, for every row at once on the device ->
    [R] int64. Plain steps ahead sample one row (next_token_tensor); a lookup run every row of its
    path, each with its position's uniform (lookup_ahead.py); a sampled tree every row, each with
    its depth's (verify.sampled_rows); the host's steps one (next_token).

    No walk back is needed here: the search returns the first index whose cumulative sum reaches
    u * total (u in [0, 1), so never past the total), and a zero-probability token's sum equals its
    predecessor's, which reached it first; so the index is a token of nonzero probability, or 0
    where u is 0 (the walk's own answer there). The walk (the host's sampler walked back row by row until
    2026-11-30; over every row at once, a cummax over the vocabulary) was 0.42 of a one-row sample's
    0.51 ms on an H200 (2026-11-30); tests compare this with it.

    On a GPU without top-p: fused_sample's two kernels (this path is their twin)."""
    if fused_sample.supported(logits, params):
        return fused_sample.fused_sample(logits, params, u)  # [R]
    return search(target_probs(logits, params), u)  # [R]


def search(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [R, V], u [R] float64 on their device -> [R] int64: each row's first index whose
    cumulative sum reaches u * the row's total (sample_rows says why it is never a token of zero
    probability, but where u is 0). Several rows on a GPU: `search_flat`; this is its twin."""
    if probs.shape[0] > 1 and probs.is_cuda:
        return search_flat(probs, u)
    cdf = probs.to(torch.float64).cumsum(-1)  # [R, V]
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).clamp_(max=probs.shape[-1] - 1)  # [R, 1]
    return idx.squeeze(-1)  # [R]


def search_flat(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`search` with one cumulative sum over the rows laid end to end: on an H200 a float64 cumsum
    over [9, V] took 241 us against 31 for one row of V (2026-11-30; the per-row scan does not
    spread a few long rows over the device). Row r's sums are the flat sums less the rows before
    it, which costs their total's last bits (about R * 2**-52 absolute): a sample can differ from
    the per-row search only where u lands within that of a step of the CDF."""
    r, v = probs.shape
    cdf = probs.to(torch.float64).reshape(-1).cumsum(0)  # [R * V]
    ends = cdf[v - 1::v]  # [R] sums through each row's end
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])  # [R]
    idx = torch.searchsorted(cdf, starts + u * (ends - starts))  # [R] flat indices
    return (idx - torch.arange(r, device=idx.device) * v).clamp_(0, v - 1)  # [R]
