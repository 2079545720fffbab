"""Shared test helpers: engines over the tiny pair, and DESIGN 3.6's near-tie rule."""

from __future__ import annotations

import torch

from specextend.attention.backends import CAUSAL
from specextend.config import EngineConfig
from specextend.draft.inprocess import InProcessDraft
from specextend.engine import Engine


def make_engine(pair, mode="sd", draft_backend=None, **kw) -> Engine:
    target, draft = pair
    backend = None if mode == "ar" else (draft_backend or InProcessDraft(draft.decoder))
    return Engine(EngineConfig(mode=mode, **kw), target, backend)


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(decoder, ids) -> float:
    """The target's top-2 logit gap for the next token after `ids` (fresh causal forward)."""
    cache = decoder.new_cache(len(ids) + 1)
    logits, _ = decoder.forward(torch.tensor(ids, device=decoder.device),
                                torch.arange(len(ids), device=decoder.device), cache, CAUSAL,
                                )
    top = torch.topk(logits[-1].float(), 2).values
    return float(top[0] - top[1])


def assert_equal_or_near_tie(decoder, prompt, ref, out, tol):
    """DESIGN 3.6: outputs equal, or the first divergence sits at a near-tie of the target."""
    i = first_divergence(ref, out)
    if i is None:
        return None
    gap = top2_gap(decoder, list(prompt) + list(ref[:i]))
    assert gap < tol, f"divergence at generated position {i} with top-2 gap {gap} >= {tol}"
    return i, gap
