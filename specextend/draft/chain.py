"""Chained levels of a background flight (docs/architecture.md, "Overlapped drafting"): after a
flight's first level, each further level forwards the best children of the level before, picked on
the device (`chain_pick`), with no host round trip between them (overlap.py, `Overlap._chain`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Chained:
    """A level of a flight after its first, forwarded without the host: its rows are the best
    children (by path score) of the level before, picked on the device."""

    start: int  # its staged slots: start .. start + R
    pick: torch.Tensor  # [R] int64 on the host: row * w + child, in the level before, of each row
    score: torch.Tensor  # [R] on the host: each row's path score (-inf: no candidate, a padding row)
    tokens: torch.Tensor  # [R, w] int64 on the host: each row's children
    logp: torch.Tensor  # [R, w] their log-probabilities
    event: Optional[torch.cuda.Event]  # recorded after its host copies (None on the CPU: done)


def chain_pick(score: torch.Tensor,  # [R] the level before's rows' path scores (-inf: padding)
               top_lp: torch.Tensor, top_ids: torch.Tensor,  # [R, w] its rows' children
               pos: torch.Tensor,  # [R] its positions
               mask: torch.Tensor,  # [R, start] bool, its mask rows (over the staged keys before this level)
               start: int) -> tuple[torch.Tensor, ...]:
    """A chained level's rows, on the device: the best R children of the level before by path
    score -> their scores [R] (best first), picks [R] (row * w + child in the level before), tokens
    [R], positions [R] and mask [R, start + R] (the parent's row, and the row's own slot)."""
    r, w = top_lp.shape
    cand = (score[:, None] + top_lp).reshape(-1)  # [R * w]
    score, pick = torch.topk(cand, r)  # [R] each
    prow = torch.div(pick, w, rounding_mode="floor")  # [R] the level before's row
    own = torch.eye(r, dtype=torch.bool, device=score.device)  # [R, R] each row's own slot
    nxt = torch.cat([mask[prow], own], dim=1)  # [R, start + R]
    return score, pick, top_ids.reshape(-1)[pick], pos[prow] + 1, nxt
