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

from typing import Callable, Optional, Sequence

import numpy as np

from specextend.lookup_gate import LookupGate, chain_run

SHORT_EXTEND = 8  # tokens up to which ContextIndex.extend runs in Python ints (a step's; a prompt's: numpy)
NGRAMS = (3, 2, 1)  # n-gram orders tried, longest first (benchmarks/lookup_offline.py: the unigram
# fallback's chains added 8-12% tokens a step on prose and docs, little on code: LookupGate decides)


class ContextIndex:
    """The request's tokens (prompt, then every committed token) and, for each n in `ns`, a key per
    n-gram (its tokens packed into an int64) and a dict from each key to its latest start among the
    n-grams that end before the last token, so that the latest earlier occurrence of the context's
    last n tokens is one dict lookup. `match_vectorised`, its twin, compares every key instead: ~20
    us an order at 16K tokens, ~60 us a step with three orders on an H100's host, on every step's
    path (docs/architecture.md, "Context lookup")."""

    def __init__(self, ids: Sequence[int], vocab_size: int, ns: Sequence[int] = NGRAMS, capacity: int = 0):
        bits = max(1, int(vocab_size - 1).bit_length())
        self.ns = tuple(sorted((n for n in ns if 0 < n * bits <= 63), reverse=True))  # longest first
        self.bits = bits
        cap = max(capacity, len(ids)) + 16
        self.ids = np.zeros(cap, dtype=np.int64)  # [cap] tokens; the first `length` are valid
        self.keys = {n: np.zeros(cap, dtype=np.int64) for n in self.ns}  # [cap] key of ids[i:i+n]
        self.latest: dict[int, dict[int, int]] = {n: {} for n in self.ns}  # n -> key -> latest start
        # among starts [0, length - n - 1] (every n-gram but the last, which is the one looked up)
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
        if hi - lo <= SHORT_EXTEND:
            self._extend_short(tokens, lo, hi)
            self.length = hi
            return
        self.ids[lo:hi] = np.asarray(tokens, dtype=np.int64)
        for n, keys in self.keys.items():
            start = max(0, lo - n + 1)  # first n-gram that ends among the new tokens
            if hi - start < n:
                continue
            k = np.zeros(hi - n + 1 - start, dtype=np.int64)
            for j in range(n):
                k = (k << self.bits) | self.ids[start + j:hi - n + 1 + j]
            keys[start:hi - n + 1] = k
        for n, keys in self.keys.items():  # the n-grams no longer last join the dict, in order
            a, b = max(0, lo - n), hi - n  # starts [a, b): later ones overwrite earlier ones
            if b > a:
                latest = self.latest[n]
                if b - a > 64:
                    latest.update(zip(keys[a:b].tolist(), range(a, b)))
                else:
                    for i in range(a, b):
                        latest[int(keys[i])] = i
        self.length = hi

    def _extend_short(self, tokens: Sequence[int], lo: int, hi: int) -> None:
        """extend for a step's few tokens in Python ints: the same ids, keys and dicts without numpy's
        per-call cost (numpy: ~20 us a token for three orders; this: 3-6 us; twin: the numpy path,
        tests/test_lookup.py). Each n-gram that ends among the new tokens gets its key; each that is
        no longer the last (it starts before hi - n) joins its order's dict, later starts last."""
        ids, bits = self.ids, self.bits
        for i, t in enumerate(tokens):
            ids[lo + i] = int(t)
        base = max(0, lo - max(self.ns, default=1))
        window = ids[base:hi].tolist()  # the tokens those n-grams read
        for n, keys in self.keys.items():
            latest = self.latest[n]
            for s in range(max(0, lo - n), hi - n + 1):
                k = 0
                for t in window[s - base:s - base + n]:
                    k = (k << bits) | t
                if s > lo - n:  # (ends among the new tokens; the one before has its key)
                    keys[s] = k
                if s < hi - n:
                    latest[k] = s

    def extend_matching(self, tokens: Sequence[int], max_tokens: int) -> list[tuple[int, Optional[int]]]:
        """extend(tokens) one token at a time, and before each token the match of the context so far:
        (its order, the continuation's first token), (0, None) where match finds none. The same
        index and the same answers as match() then extend([t]) per token (tests/test_lookup.py),
        with the last n-grams' keys rolled in Python ints: a run of plain steps ahead teaches the
        gate with it, where the per-token calls cost the tiny pair on a CPU ~4% of `ar`'s speed
        (docs/architecture.md, "Plain steps ahead")."""
        L, bits, out = self.length, self.bits, []
        self._grow(L + len(tokens))
        ids = self.ids
        cur = {n: int(self.keys[n][L - n]) if L >= n else None for n in self.ns}  # the last n-grams' keys
        for t in tokens:
            t = int(t)
            found = (0, None)
            for n in self.ns if max_tokens > 0 else ():
                if L > n:
                    start = self.latest[n].get(cur[n])
                    if start is not None:
                        found = (n, int(ids[start + n]))
                        break
            out.append(found)
            ids[L] = t
            L += 1
            for n in self.ns:
                k = cur[n]
                if k is not None:
                    self.latest[n][k] = L - 1 - n  # (no longer the last n-gram)
                    k = ((k << bits) | t) & ((1 << (n * bits)) - 1)
                elif L == n:  # (the first n-gram)
                    k = 0
                    for x in ids[:n].tolist():
                        k = (k << bits) | x
                if k is not None:
                    self.keys[n][L - n] = k
                cur[n] = k
        self.length = L
        return out

    def continuation(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the context's
        last n tokens, for the longest n that occurred before; [] if none did."""
        return self.match(max_tokens)[1]

    def match(self, max_tokens: int) -> tuple[int, list[int]]:
        """(n, continuation): the order of the n-gram that found it too (0 with none)."""
        L = self.length
        if max_tokens <= 0:
            return 0, []
        for n in self.ns:
            if L <= n:
                continue
            start = self.latest[n].get(int(self.keys[n][L - n]))
            if start is not None:
                i = start + n  # what followed it
                return n, self.ids[i:min(i + max_tokens, L)].tolist()
        return 0, []

    def match_vectorised(self, max_tokens: int) -> tuple[int, list[int]]:
        """match's twin: every earlier key compared with the last one's."""
        L = self.length
        if max_tokens <= 0:
            return 0, []
        for n in self.ns:
            if L <= n:
                continue
            keys = self.keys[n]
            hits = np.flatnonzero(keys[:L - n] == keys[L - n])  # occurrences that end before the last token
            if hits.size:
                i = int(hits[-1]) + n  # what followed it
                return n, self.ids[i:min(i + max_tokens, L)].tolist()
        return 0, []


def continuation_scan(ids: Sequence[int], max_tokens: int, ns: Sequence[int] = NGRAMS) -> list[int]:
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


def drafted_prefix(accepted: Sequence[int], drafted: int) -> list[int]:
    """The accepted path's nodes up to the first that a lookup chain added (index >= drafted: `graft`
    appends a chain's nodes after the draft's)."""
    n = 0
    while n < len(accepted) and accepted[n] < drafted:
        n += 1
    return list(accepted[:n])


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


class RequestLookup:
    """A request's lookup: its context index, the gate and the target's forward cost line
    (`cost(rows)`, seconds; None: every chain is verified). Each step asks for a chain (`chain`,
    a step without a tree; `graft`, a tree) and then `commit`s what it emitted, which teaches the
    gate and extends the index."""

    def __init__(self, index: ContextIndex, max_tokens: int, cost: Optional[Callable[[int], float]] = None,
                 gate: Optional[LookupGate] = None, graft_cost: Optional[Callable[[int], float]] = None,
                 cost_known: Optional[Callable[[], bool]] = None) -> None:
        self.index, self.max_tokens, self.cost = index, max_tokens, cost
        self.graft_cost = graft_cost if graft_cost is not None else cost  # (a tree's rows: grafted chains)
        # whether `cost` has measured a chain's rows (its own slope; None: it has): until then the
        # first chain found is verified, so that a slope lent by the trees' verifications cannot
        # keep chains out for good (TreeController.chains)
        self.cost_known = cost_known
        self.gate = gate if gate is not None else LookupGate()
        self._step: Optional[tuple[int, list[int], bool]] = None  # this step's (order, chain, verified)
        self._rows = 0  # a step without a tree: the rows it verified (1: plain); 0 after a tree
        self._host_skips = 0  # chains skipped for the chain steps' host work alone, since the last recheck
        self._recheck = False  # this step verifies one to re-measure that work
        self.found = False  # the index had a chain at the last peek or graft (verified or not)
        self.gain_now = 0.0  # the tokens the gate expects of the chain found at the last peek (0: none)
        self.skipped = 0  # steps without a tree (runs' tokens too) whose chain found was not verified

    def _pays(self, n: int, nodes: int, alone: bool) -> bool:
        return self.cost is None or self.gate.use(n, nodes, self.cost if alone else self.graft_cost, alone)

    def _host_bound(self, n: int, nodes: int) -> bool:
        return self.cost is not None and self.gate.host_bound(n, nodes, self.cost)

    def _bound_orders(self) -> frozenset:
        """The orders whose chains of `max_tokens` nodes are host-bound now, for a run's tokens to
        count (the cost line and the rates barely move within a run; once per run, not per token:
        2.6 us a token on this project's CPU); none once a recheck is due."""
        if self._host_skips >= self.gate.recheck_every - 1:
            return frozenset()
        return frozenset(n for n in self.index.ns if self._host_bound(n, self.max_tokens))

    def peek(self) -> tuple[int, float]:
        """(nodes, expected added tokens) of the chain a step without a tree would verify now, (0,
        0.0) if none (the adaptive policy's choice between such a step and a tree: controller.chain_now)."""
        n, chain = self.index.match(self.max_tokens)
        self.found = bool(chain)  # (a tree step grafts a chain that does not pay alone: controller.rate)
        self.gain_now = min(self.gate.gain(n), float(len(chain))) if chain else 0.0  # (paying alone or not)
        if not chain or not self._pays(n, len(chain), alone=True):
            return 0, 0.0
        return len(chain), self.gain_now

    def chain(self) -> list[int]:
        """The chain a step without a tree verifies ([]: it decodes one token plainly)."""
        n, chain = self.index.match(self.max_tokens)
        used = bool(chain) and (self._pays(n, len(chain), alone=True)
                                or (self.cost_known is not None and not self.cost_known()))
        if chain and not used and self._host_bound(n, len(chain)):  # (docs: "Context lookup", recheck)
            self._host_skips += 1
            used = self._recheck = self._host_skips >= self.gate.recheck_every
            self._host_skips = 0 if used else self._host_skips
        self._step = (n, chain, used) if chain else None
        self.skipped += bool(chain) and not used
        self._rows = len(chain) + 1 if used else 1
        return chain if used else []

    def graft(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[list[int], list[int], int]:
        """The draft's tree with the chain grafted (graft), where its new nodes pay for their rows."""
        n, chain = self.index.match(self.max_tokens)
        self._rows, self.found = 0, bool(chain)
        if not chain:
            self._step = None
            return list(tokens), list(parents), 0
        out_t, out_p, new = graft(tokens, parents, chain)
        used = self._pays(n, new, alone=False)
        self._step = (n, chain, used)
        return (out_t, out_p, new) if used else (list(tokens), list(parents), 0)

    def commit_run(self, emitted: Sequence[int]) -> None:
        """A run of plain steps (plain_ahead.plain_run_co) emitted `emitted`, asking for no chain:
        each token teaches the gate what the chain a plain step would have skipped there (if any)
        would have given, as such a step's commit does, and extends the index."""
        bound = self._bound_orders()
        # each as a plain step whose chain (if any) was skipped: chain(), then commit (no host work to learn)
        for tok, (n, first) in zip(emitted, self.index.extend_matching(emitted, self.max_tokens)):
            if first is not None:
                self._host_skips += n in bound
                self.skipped += 1
                self.gate.observe_skipped(n, int(tok) == first)
        self._step, self._rows, self._recheck = None, 0, False

    def commit_ahead(self, emitted: Sequence[int]) -> None:
        """A step of a lookup run (lookup_ahead.py), whose chain the device found and verified: its
        tokens extend the index; the gate, which prices the host's chain steps, learns nothing."""
        self._step, self._rows = None, 0
        self.index.extend(emitted)

    def could_pay(self) -> bool:
        """Whether a chain could be worth verifying alone now, of any order, by its gate's rates and
        the cost line: a chain of `max_tokens` nodes, what `chain` finds in a long context (the
        continuation after the n-gram's latest occurrence; shorter only where that occurrence is
        within `max_tokens` of the end) and verifies whole or not at all. False: a run of plain
        steps forgoes nothing that would be verified (any chain found in it would be skipped); its
        commit_run teaches the gate on. (A one-node chain, the cheapest, used to be asked: on a GPU,
        where a row costs ~1.5% of a forward, it paid at hit rates where the chains actually found
        did not, so such a request took neither chains nor runs: docs/architecture.md, "Plain steps
        ahead".)"""
        return any(self._pays(n, self.max_tokens, alone=True) or (self._host_skips >= self.gate.recheck_every - 1
                   and self._host_bound(n, self.max_tokens)) for n in self.index.ns)

    @property
    def priced(self) -> bool:
        """Whether the gate has measured a plain step's host work (a plain step's commit teaches it):
        runs of plain steps, which teach it nothing of that, wait for it."""
        return self.gate.host[False] is not None

    def commit(self, emitted: Sequence[int], step_s: Optional[float] = None) -> None:
        """The step emitted `emitted` (committed order); `step_s`: a step without a tree's wall time,
        which teaches the gate its host work beyond the forward (the cost line's). A verified
        chain teaches the gate the tokens it would have given alone: its leading tokens that the
        step emitted, on a tree step too, where the draft's own nodes may have proposed them as
        well (counting only the tokens the chain added beyond the tree's taught a good draft's
        requests that chains never hit, and the next request's plain steps then skipped them:
        docs/architecture.md, "Context lookup")."""
        if step_s is not None and self._rows and self.cost is not None and self.cost(1) > 0:
            self.gate.observe_host(self._rows > 1, max(step_s - self.cost(self._rows), 0.0), fresh=self._recheck)
            if self._recheck and self._step is not None:
                self.gate.rechecked(self._host_bound(self._step[0], self.max_tokens))
        self._rows, self._recheck = 0, False
        if self._step is not None:
            n, chain, used = self._step
            if used:
                self.gate.observe(n, chain_run(chain, emitted))
            else:
                self.gate.observe_skipped(n, bool(emitted) and int(emitted[0]) == int(chain[0]))
            self._step = None
        self.index.extend(emitted)
