"""Context lookup: continuations copied from the request's own tokens, grafted onto the draft's tree
(docs/architecture.md, "Context lookup"). Pure functions and one small index; no model.

A long input is what this product serves, and what a model writes about a long input often repeats
it: names, phrases, lines it quotes, code it adapts. When the last `n` committed tokens occurred
earlier in the context, the tokens that followed them there are a free guess at what follows now:
no draft forward made them, so a chain of them can be as deep as the guess runs, where the draft's
own tree deepens by one level per forward. The target verifies the chain like any other branch
(`graft` joins it to the tree where the draft proposed the same tokens), so the output is the target's
alone, greedy or sampled: lossless whatever the guess.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class ContextIndex:
    """The request's tokens (prompt, then every committed token) and, for each n in `ns`, a key per
    n-gram (its tokens packed into an int64), so that the latest earlier occurrence of the context's
    last n tokens is one vectorised comparison (~10-20 us at 30K tokens)."""

    def __init__(self, ids: Sequence[int], vocab_size: int, ns: Sequence[int] = (3, 2), capacity: int = 0):
        bits = max(1, int(vocab_size - 1).bit_length())
        self.ns = tuple(sorted((n for n in ns if 0 < n * bits <= 63), reverse=True))  # longest first
        self.bits = bits
        cap = max(capacity, len(ids)) + 16
        self.ids = np.zeros(cap, dtype=np.int64)  # [cap] tokens; the first `length` are valid
        self.keys = {n: np.zeros(cap, dtype=np.int64) for n in self.ns}  # [cap] key of ids[i:i+n]
        self.length = 0
        self.extend(ids)

    def _grow(self, need: int) -> None:
        if need <= self.ids.shape[0]:
            return
        cap = max(need, 2 * self.ids.shape[0])
        self.ids = np.concatenate([self.ids, np.zeros(cap - self.ids.shape[0], dtype=np.int64)])
        self.keys = {n: np.concatenate([k, np.zeros(cap - k.shape[0], dtype=np.int64)]) for n, k in self.keys.items()}

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends committed tokens; the keys of every n-gram they complete."""
        if not len(tokens):
            return
        lo, hi = self.length, self.length + len(tokens)
        self._grow(hi)
        self.ids[lo:hi] = np.asarray(tokens, dtype=np.int64)
        for n, keys in self.keys.items():
            start = max(0, lo - n + 1)  # first n-gram that ends among the new tokens
            if hi - start < n:
                continue
            k = np.zeros(hi - n + 1 - start, dtype=np.int64)
            for j in range(n):
                k = (k << self.bits) | self.ids[start + j:hi - n + 1 + j]
            keys[start:hi - n + 1] = k
        self.length = hi

    def continuation(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the context's
        last n tokens, for the longest n that occurred before; [] if none did."""
        L = self.length
        if max_tokens <= 0:
            return []
        for n in self.ns:
            if L <= n:
                continue
            keys = self.keys[n]
            hits = np.flatnonzero(keys[:L - n] == keys[L - n])  # occurrences that end before the last token
            if hits.size:
                i = int(hits[-1]) + n  # what followed it
                return self.ids[i:min(i + max_tokens, L)].tolist()
        return []


def continuation_scan(ids: Sequence[int], max_tokens: int, ns: Sequence[int] = (3, 2)) -> list[int]:
    """ContextIndex.continuation's twin: a plain scan of the token list."""
    L = len(ids)
    for n in sorted(ns, reverse=True):
        if L <= n or max_tokens <= 0:
            continue
        suffix = list(ids[L - n:])
        for i in range(L - n - 1, -1, -1):
            if list(ids[i:i + n]) == suffix:
                return list(ids[i + n:min(i + n + max_tokens, L)])
    return []


def graft(tokens: Sequence[int], parents: Sequence[int], chain: Sequence[int]) -> tuple[list[int], list[int], int]:
    """The tree with `chain` (tokens after the root, in order) joined to it: the chain follows the
    tree's nodes while they carry its tokens, and its remaining tokens hang below as a path of new
    nodes, appended after the tree's (topological order kept; the tree's nodes keep their indices).
    Returns (tokens [N'], parents [N'], N' - N new nodes)."""
    out_t, out_p = list(tokens), list(parents)
    child = {(p, t): i for i, (t, p) in reversed(list(enumerate(zip(tokens, parents))))}  # first such child
    node, new = -1, 0
    for tok in chain:
        nxt = child.get((node, tok))
        if nxt is None:
            out_t.append(int(tok))
            out_p.append(node)
            nxt = len(out_t) - 1
            child[(node, tok)] = nxt
            new += 1
        node = nxt
    return out_t, out_p, new
