"""A draft session's context-lookup chains (docs/architecture.md, "Context lookup"): with overlapped
drafting, the continuation that the request's own tokens suggest joins the candidate pool after
every answer, so that the background forwards extend it like any other branch and a verdict that
runs through it (the target verifies the same chain, grafted onto the tree) finds its nodes
forwarded: a ready step instead of a miss and a catch-up.

The chain's prior is how often the chains found through the same n-gram order were right lately:
the first token after each root, as the next step's verdict tells (an average per order: the
last-token fallback's chains are weaker guesses than a trigram's), so that chains that keep missing
sink below the draft's own candidates and cost no background forward.
"""

from __future__ import annotations

import math
from typing import Sequence

from specextend.draft.pool import Pool
from specextend.lookup import ContextIndex

HIT_PRIOR = 0.5  # the chains' hit rate before any verdict
HIT_ALPHA = 0.2  # weight of the newest verdict in the average
HIT_RANGE = (0.02, 0.9)  # the prior's bounds (a chain token is never certain, nor worthless)


class LookupChains:
    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, tokens: int, capacity: int = 0):
        self.index = ContextIndex(prompt_ids, vocab_size, capacity=capacity)
        self.tokens = tokens  # chain length
        self.last: list[int] = []  # the chain seeded below the current root
        self.order = 0  # the n-gram order that found it
        self.hits: dict[int, float] = {}  # order -> its chains' hit rate (average)
        self.seeded = 0  # nodes the chains added to the pool

    @property
    def hit(self) -> float:
        """The hit rate of the last chain's order."""
        return self.hits.get(self.order, HIT_PRIOR)

    @property
    def logp(self) -> float:
        lo, hi = HIT_RANGE
        return math.log(min(max(self.hit, lo), hi))

    def accepted(self, tokens: Sequence[int]) -> None:
        """A step's committed tokens (its verdict, after any plain steps' tokens): the last chain's
        first token against the first of them, then the index grows."""
        if self.last and tokens:
            self.hits[self.order] = (1 - HIT_ALPHA) * self.hit + HIT_ALPHA * float(tokens[0] == self.last[0])
        self.last = []
        self.index.extend(tokens)

    def seed(self, pool: Pool) -> int:
        """The continuation after the current root joins `pool`; returns the nodes it added."""
        self.order, chain = self.index.match(self.tokens)
        self.last = chain
        if not chain:
            return 0
        added = pool.add_chain(chain, self.logp)
        self.seeded += added
        return added
