"""Context lookup on the device (docs/architecture.md, "Lookup runs ahead"): the request's tokens in a
device buffer, the chain that ContextIndex.match would find computed there, and a chain's
verdict, all without the host, so that a run of lookup steps can be queued ahead of the host as
plain decoding's steps are (lookup_ahead.py). Pure tensor functions with static shapes: no value
leaves the device, nothing synchronises. Slow twins: ContextIndex.match (lookup.py) and
verify.verify_tree on a path; tests/test_lookup_ahead.py compares them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specextend.lookup import NGRAMS


def device_match(hist: torch.Tensor, length: torch.Tensor, q: int,
                 ns: Sequence[int] = NGRAMS) -> tuple[torch.Tensor, torch.Tensor]:
    """ContextIndex.match on the device. hist [C] int64: the request's tokens, the first `length`
    ([1] int64, on hist's device) valid. For the longest n in `ns` whose last n tokens occurred
    earlier (a start s <= length - n - 1), the latest such s: the chain is hist[s + n:], at most `q`
    tokens and none at or past `length`. -> (chain [q] int64, its count [1] int64; 0: no match; the
    entries past the count are junk)."""
    c = hist.shape[0]
    dev = hist.device
    nmax = max(ns)
    ar = torch.arange(c, device=dev)  # [C]
    tail = hist[(length - nmax + torch.arange(nmax, device=dev)).clamp(min=0)]  # [nmax]: the last nmax tokens
    eq = hist.unsqueeze(0) == tail.unsqueeze(1)  # [nmax, C]: eq[j, s] = hist[s] == tail[j]
    first = torch.full((1,), -1, dtype=torch.long, device=dev)  # where the chain starts (-1: none yet)
    for n in sorted(ns, reverse=True):  # longest first
        hit = eq[nmax - n].clone()  # [C]: hist[s] == the n-gram's first token
        for j in range(1, n):  # ... and hist[s + j] == its j-th (the shift leaves the last j starts False)
            hit[:c - j] &= eq[nmax - n + j, j:]
            hit[c - j:] = False
        ok = hit & (ar <= length - n - 1) & (length > n)  # [C] earlier occurrences only
        s = torch.where(ok, ar, -1).max().view(1)  # [1] the latest, -1 if none
        first = torch.where((first < 0) & (s >= 0), s + n, first)
    count = torch.where(first >= 0, (length - first).clamp(min=0, max=q), 0)  # [1]
    chain = hist[(first.clamp(min=0) + torch.arange(q, device=dev)).clamp(max=c - 1)]  # [q]
    return chain, count


def accepted(y: torch.Tensor, chain: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The verdict of a path [root, chain[0..q-1]] whose first `count` ([1]) chain tokens are real,
    given y [q + 1], the target's token after each row (its argmax, or its sample: sampling.sample_rows):
    n [1], the leading chain tokens y confirms. The step emits y[:n + 1] (the accepted tokens, then
    the target's own), as verify_tree does for a path."""
    q = chain.shape[0]
    ok = (y[:q] == chain) & (torch.arange(q, device=y.device) < count)  # [q]
    return ok.to(torch.long).cumprod(0).sum().view(1)
