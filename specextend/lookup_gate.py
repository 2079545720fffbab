"""The context lookup's gate (docs/architecture.md, "Context lookup"): per n-gram order, whether a
chain found through it is worth verifying, from how often such chains hit and what their rows and
their steps' host work cost; and when a chain priced out by that host work is verified anyway (a
recheck). Carried from a request to the next with the engine's costs. Pure Python; no model."""

from __future__ import annotations

from typing import Optional, Sequence


# A chain step's host work is measured only by chain steps: where that average prices every chain
# out (measured under contention, carried from another request), every `recheck_every`-th chain
# that would pay by its rows alone is verified anyway and its measurement replaces the average.
# The interval starts at HOST_RECHECK, doubles (up to MAX_HOST_RECHECK) after each recheck whose
# measurement still prices the chains out, returns to HOST_RECHECK after one that lets them pay,
# and is carried with the gate (docs/architecture.md, "Context lookup").
HOST_RECHECK = 16
MAX_HOST_RECHECK = 1024


class LookupGate:
    """Whether a step without a draft tree verifies a chain found through an n-gram of order n or
    decodes one token plainly: per order, the chains' expected added tokens (how often their first
    token was the target's, from verified chains and from plain steps alike, times the tokens
    accepted when it was), against what the chain's rows cost the target beyond one row's forward
    (`cost(rows)`, seconds; the adaptive controller's line). A chain of g expected tokens over k
    nodes pays when (1 + g) / cost(k + 1) >= 1 / cost(1). A weak order loses little: the plain steps
    that skip its chains still tell whether they would have hit (docs/architecture.md, "Context lookup")."""

    def __init__(self, alpha: float = 0.1, hit_prior: float = 0.5, run_prior: float = 2.0) -> None:
        self.alpha = alpha
        self.hit: dict[int, float] = {}  # order -> share of its chains whose first token was the target's
        self.run: dict[int, float] = {}  # order -> tokens accepted from its chains that hit (average)
        self.hit_prior, self.run_prior = hit_prior, run_prior
        # seconds of a step beyond its forward (the host's work, the device idle), for steps that
        # verified a chain and for plain steps (averages; None until measured: observe_host)
        self.host: dict[bool, Optional[float]] = {True: None, False: None}
        self.recheck_every = HOST_RECHECK  # host-bound chains skipped before one is verified anyway

    def carried(self) -> "LookupGate":
        """A copy to start the engine's next request from (its hit rates, runs and host costs; the
        next text's chains correct the rates at no cost: a skipped chain still teaches the gate)."""
        out = LookupGate(self.alpha, self.hit_prior, self.run_prior)
        out.hit, out.run, out.host = dict(self.hit), dict(self.run), dict(self.host)
        out.recheck_every = self.recheck_every
        return out

    def rechecked(self, still_bound: bool) -> None:
        """A recheck's measurement is in: the next one comes twice as late if the chains are still
        priced out by their host work, else at the first interval again."""
        self.recheck_every = min(2 * self.recheck_every, MAX_HOST_RECHECK) if still_bound else HOST_RECHECK

    def gain(self, n: int) -> float:
        return self.hit.get(n, self.hit_prior) * self.run.get(n, self.run_prior)

    def use(self, n: int, nodes: int, cost, alone: bool = False) -> bool:
        """`alone`: the chain is a step's only draft (a step without a tree), whose host work is a
        chain step's instead of a plain one's; a chain grafted onto a tree adds only its rows."""
        one, rows = cost(1), cost(nodes + 1)
        if one <= 0:  # no line measured yet
            return True
        chain, plain = self.host[True], self.host[False]
        if alone and chain is not None and plain is not None:  # a chain step's verification and
            one, rows = one + plain, rows + chain  # bookkeeping on the host cost more than a plain step's
        return (1.0 + self.gain(n)) * one >= rows

    def observe_host(self, chained: bool, seconds: float, fresh: bool = False) -> None:
        """A step's seconds beyond its forward: one that verified a chain, or a plain one; `fresh`:
        a re-measurement of an average that priced its steps out (RequestLookup's recheck), which
        replaces it."""
        old = self.host[chained]
        self.host[chained] = seconds if old is None or fresh else (1 - self.alpha) * old + self.alpha * seconds

    def host_bound(self, n: int, nodes: int, cost) -> bool:
        """Whether a chain step of this chain pays by its rows but not with the host work measured for
        chain steps: only such a step measures that work, so it is rechecked now and then."""
        chain, plain = self.host[True], self.host[False]
        if chain is None or plain is None or chain <= plain:  # (then a chain that pays by rows pays alone)
            return False
        return self.use(n, nodes, cost) and not self.use(n, nodes, cost, alone=True)

    def observe(self, n: int, accepted: int) -> None:
        """A verified chain of order n: the tokens the target accepted from it."""
        self._hit(n, accepted > 0)
        if accepted > 0:
            self.run[n] = (1 - self.alpha) * self.run.get(n, self.run_prior) + self.alpha * accepted

    def observe_skipped(self, n: int, first_hit: bool) -> None:
        """A chain of order n left out of a plain step whose token was (or not) its first."""
        self._hit(n, first_hit)

    def _hit(self, n: int, hit: bool) -> None:
        self.hit[n] = (1 - self.alpha) * self.hit.get(n, self.hit_prior) + self.alpha * float(hit)


def chain_run(chain: Sequence[int], emitted: Sequence[int]) -> int:
    """How many of `chain`'s leading tokens the step emitted: what verifying the chain alone would
    have accepted (a rejected chain token is never the bonus token that replaces it)."""
    k = 0
    while k < min(len(chain), len(emitted)) and int(chain[k]) == int(emitted[k]):
        k += 1
    return k
