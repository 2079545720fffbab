"""Speculation that never loses: a per-session choice, step by step, of the next step's tree
among a small ladder of sizes, plain decoding (no tree) included (docs/architecture.md,
"Adaptive speculation").

The ladder: plain, then trees of 4, 8, 16, ... nodes up to the session's tree, each size also
three levels deep where its own depth is more (`ladder.ladder`). For each rung the controller predicts
tokens per second and takes the best:

    plain:          1 / forward(1)
    tree (n, d):    (1 + accepted(n, d)) / (draft(d) + forward(n + 1))

from what it measured at this session's actual context, online (docs/architecture.md, "Adaptive
speculation", says why each is measured so):
- `forward(rows)`: a target forward's seconds, a line a + b * rows (`LinearCost`) over every forward
  of the session, on a GPU the device's time between CUDA events (timing.py); B sessions sharing a
  forward (scheduler.Batcher) are charged a / B + b * rows each, so trees shrink smoothly as the
  batch grows. A session alone adds to the line, for a tree size it has verified ROW_MIN times,
  what those verifications took beyond it (`rows_price`: a GEMM's cost is a step in rows, not a line).
- `draft(depth)`: seconds the target waited for a tree, a line over its depth (flat with overlap).
- `extra`: a step's wall time beyond its forwards and its wait (host work), for speculative and for
  plain steps.
- `accepted(n, d)`: accepted draft tokens per rung, averaged with weights that decay with steps; one
  verification measures every rung inside its tree (trees are sent best first:
  `ladder.prefix_accepts`, exact for the same draws).
- `ready`: with an overlapping draft, the share of asked trees that came (`record_unready`).
- with overlap, trees come in runs whose first step (after a plain or an unready one) waits longer
  and takes less than the rest: its own averages (`switch_*`), priced by `value` (`costs.run_rate`);
  the warm-up and probes last until a tree after a tree has been verified.
A rung larger than any verified lately keeps its last estimate (or, never seen, the estimate of
the largest rung inside it: a lower bound). So that those estimates stay current, while the best
rung is not the top one the controller probes the top rung now and then: after enough steps that
probes lose about a tenth of the time against the best rung, the interval doubling after each probe that does not move
the choice up (as far as `max_probe`). Lossless by construction: a plain step is plain decoding,
and any tree is verified; the controller only changes what is proposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specextend.controller_carry import WARM_MARGIN, Carrying
from specextend.controller_probe import Probing
from specextend.controller_record import PROBE_RETRIES, ROW_MIN, SWITCH_ALPHA, Recording  # noqa: F401 (re-exported)
from specextend.controller_best import best_rung
from specextend.costs import OUTLIER, RUN_STEPS, LinearCost, run_rate
from specextend.recheck import PlainRecheck
from specextend.ladder import PLAIN, Rung

# draft prefill / target prefill from which the session starts plain (TreeController.seed_draft): at
# 1 a draft level costs about a target forward and no tree can pay; the margin covers what the
# proxy misses (two prefills sharing a CPU, one-off costs of a first open; the tiny test pair, a
# same-size copy of its target, measures 0.8 on 2 CPU cores, the 68M draft beside it about 12)
SLOW_DRAFT = 3.0

# With overlap, a tree step may find nothing ready (record_unready): the warm-up's trees are asked
# up to this many times in all before the session decides without their measurements, and a probe
# that met one asks once more (controller_record.PROBE_RETRIES) before it counts as done
WARM_TRIES = 4
# (overlap) first asks in a row that found no tree (began no run) from which a switch is priced as
# taking that many more asks (TreeController.value): fewer come in clusters where runs pay (half of the
# first asks failing: six in a row one time in 64)
DOUBT_MISSES = 6


def _forwards() -> LinearCost:
    """A line of forwards' durations: a one-off among them counts as at most OUTLIER times the line."""
    return LinearCost(clip=OUTLIER)


@dataclass
class TreeController(Recording, Carrying, Probing):
    rungs: list[Rung]  # ladder(): plain first, the session's tree last
    warmup: int = 2  # speculative steps before the first decision: the smallest tree, then (after a plain
    # step) the largest if it may pay
    min_probe: int = 4  # steps before a probe, at least
    probe_ratio: float = 10.0  # ... and this many times the time a probe loses against the best choice
    max_probe: int = 1024
    probe_every_s: float = 2.0  # ... and a probe at least this often, in predicted seconds (costs.probe_cap)
    governed = True  # (not a field) a batch's governor may hold its steps plain or to trees (governor.py)
    alpha: float = 0.3  # weight of the newest step in the acceptance averages
    forward: LinearCost = field(default_factory=_forwards)  # target forward seconds vs rows, the steps'
    # rows -> [average residual seconds, verifications]: what this session's verifications alone of that
    # many rows took beyond the line (forward_seconds adds it; a GEMM's cost is a step in rows); not carried
    rows_price: dict = field(default_factory=dict)
    prefill: LinearCost = field(default_factory=_forwards)  # ... the prefill's chunks: the steps' prior
    # ... the forwards of steps without a tree alone (plain and chain steps): what a chain verified
    # alone costs, which the trees' verifications, with their own rows' price, must not set (the tiny
    # pair on a CPU: the line of every step priced a 9-row chain at 3.1 ms where chain steps took
    # 2.2, and skipped every chain that mode lookup verified; docs/architecture.md, "Context lookup")
    chains: LinearCost = field(default_factory=_forwards)
    draft: LinearCost = field(default_factory=lambda: LinearCost(proportional=True))  # wait vs depth
    # the first tree after steps without one: the draft first forwards their tokens, a wait beyond the
    # levels' line, vs those tokens (record_spec's catchup), priced into a tree chosen while the
    # draft is `behind` (the engine's count before each choice; 0 within a run of trees). Unpriced,
    # a probe after plain steps cost twice its prediction (the tiny pair on a CPU, 12.4 against 6.2
    # ms; the real pair on an H200 waited 8.5-9.6 ms where trees within runs waited 4-4.5):
    # docs/architecture.md, "Adaptive speculation"
    catchup: LinearCost = field(default_factory=LinearCost)
    behind: int = 0
    accepted: dict = field(default_factory=dict)  # Rung -> average accepted draft tokens
    measured_at: dict = field(default_factory=dict)  # Rung -> the step it was last measured
    sessions: int = 1  # sessions sharing the target's forwards (the driver says, choose())
    spec_steps: int = 0
    plain_steps: int = 0
    probe_steps: int = 0
    since_probe: int = 0  # steps since the last probe (or the start, or the last step with the top rung best)
    probe_every: int = 0  # 0: to be set from the costs when a probe is next considered
    extra_spec: Optional[float] = None  # a speculative step's seconds beyond forwards and draft wait (average)
    extra_plain: Optional[float] = None  # a plain step's seconds beyond its forward (average)
    plain_forward: Optional[float] = None  # a plain step's forward seconds, alone (average)
    draft_ratio: Optional[float] = None  # the draft's prefill over the target's, when it says drafting cannot pay
    lookup_plain: float = 0.0  # tokens a plain step's context-lookup chain added (average; engine.py)
    # the chain a step without a tree would verify now: (its nodes, the tokens it is expected to add;
    # RequestLookup.peek), set by the engine before each choice; None: the average above
    chain_now: Optional[tuple[int, float]] = None
    lookup_spec: float = 0.0  # tokens a speculative step's lookup chain added beyond the draft's path,
    # averaged over the tree steps that had a chain (record_spec), credited where there is one now:
    chain_found: bool = True  # the context has a chain now (RequestLookup.found; True: not known)
    # the tokens the gate expects of that chain, whether or not it pays alone (RequestLookup.gain_now;
    # None: not known): what it adds to a tree is at most what it gives alone, so a tree's credit
    # for chains is bounded by it (one chain, one price: a step-by-step trace on an H200 found trees
    # credited 3-4.4 chain tokens where a step without a tree was credited 0.1-1.3 for the same
    # chain, and trees taking chains of 8 at 7-13 ms a step that `lookup` took at 2.7, 2026-11-29)
    chain_gain: Optional[float] = None
    ready: float = 1.0  # share of the tree steps asked whose tree the draft had (average; with overlap < 1)
    overlap: bool = False  # the draft overlaps: a run of tree steps has a first step unlike the rest
    in_run: bool = False  # the last step asked for a tree and verified one (a tree step now continues the run)
    asking: bool = False  # the last step asked for a tree (verified or not: not a plain step)
    steady: bool = False  # (overlap) a tree step that continued a run has been verified
    switch_tokens: Optional[float] = None  # (overlap) a run's first tree step: tokens (average) ...
    switch_s: Optional[float] = None  # ... and wall seconds (average)
    switch_misses: int = 0  # ... and how many of them in a row found no tree ready (began no run)
    open_s: float = 0.0  # a deferred draft open's expected seconds, which the next probe costs too (price_open)
    unready_steps: int = 0  # tree steps asked that got none (decoded plainly: record_unready)
    _probe_misses: int = 0  # unready answers to the probe under way
    primed: bool = False  # started from carried Costs
    _warm: bool = False  # ... and skips the warm-up steps that measure them
    _probing: bool = False
    _measuring_top: bool = False  # a warm-up's full tree under way (verified, it restarts the probe schedule)
    _best: Optional[Rung] = None  # the choice before the probe
    _probe: Optional[Rung] = None  # the probe's rung
    _probe_by_prior: bool = False  # ... chosen while the prior priced the draft (seed_draft)
    recheck: PlainRecheck = field(default_factory=PlainRecheck)  # the way back to plain steps (recheck.py)
    _forward_s: float = 0.0  # forward seconds recorded since the last step ended
    _rows: int = 0  # ... and their rows
    last_forward_s: float = 0.0  # the last recorded step's forward seconds (its split, stats.step_done)
    predicted: dict = field(default_factory=dict)  # "tree"/"plain" -> [sum of predicted tokens/s, steps]
    _pending: list = field(default_factory=list)  # (rows, seconds or timing.Span, its line) not yet in it

    def __post_init__(self) -> None:
        self.forward.prior = self.prefill
        self.chains.prior = self.forward  # (its line until chain steps tell one of their own)
        if self.overlap and self.draft.proportional and not self.draft.known:
            self.draft = LinearCost()  # a ready tree's wait is the answer's way, not its depth's drafting

    @property
    def top(self) -> Rung:
        return self.rungs[-1]

    def expected_accepted(self, rung: Rung) -> float:
        """The rung's average, else the largest rung's inside it (no more nodes, no deeper: a lower
        bound), else 0."""
        for r in reversed(self.rungs[1:self.rungs.index(rung) + 1]):
            if r in self.accepted and r.depth <= rung.depth:
                return self.accepted[r]
        return 0.0

    def forward_seconds(self, rows: int, share: float, b: float) -> float:
        """A verification forward of `rows` charged to this session: the line's (`share`, this
        session's share of its fixed cost, + `b` a row), and, a session alone, what forwards of exactly
        that many rows took beyond the line (`rows_price`, once ROW_MIN were measured)."""
        fwd = share + b * rows
        if self.sessions <= 1:
            price = self.rows_price.get(rows)
            if price is not None and price[1] >= ROW_MIN:
                return max(fwd + price[0], 0.0)
        return fwd

    def _verified_seconds(self, rung: Rung) -> float:
        """Predicted seconds of a step of `rung` that verifies its tree (or, plain, decodes), charged
        to this session (its share of a shared forward's fixed cost, its own rows and draft)."""
        a, b = self.forward.line()
        share = a / max(self.sessions, 1)
        if rung.plain:
            fwd = share + b * (rung.nodes + 1)
            if self.plain_forward is not None and self.sessions <= 1:
                fwd = self.plain_forward  # measured: the line is mostly verifications, a costlier path
            rows = self.chain_now[0] if self.chain_now else 0  # (a chain's rows: the chain steps' slope)
            return fwd + self.chains.line()[1] * rows + (self.extra_plain or 0.0)
        fwd = self.forward_seconds(rung.nodes + 1, share, b)
        return fwd + self.draft_seconds(rung.depth) + (self.extra_spec or 0.0) + self.catchup_seconds()

    def catchup_seconds(self) -> float:
        """The predicted wait for the draft to forward the tokens it is `behind` on before its levels."""
        return self.catchup(self.behind) if self.behind > 0 and self.catchup.known else 0.0

    def step_seconds(self, rung: Rung) -> float:
        """Predicted seconds of a step of `rung`: a tree step asks for a tree (the wait), and gets
        one in a `ready` share of the steps, else it decodes plainly."""
        if rung.plain or self.ready >= 1.0:
            return self._verified_seconds(rung)
        unready = self.draft_seconds(rung.depth) + self._verified_seconds(PLAIN)
        return self.ready * self._verified_seconds(rung) + (1 - self.ready) * unready

    def rate(self, rung: Rung) -> float:
        """Predicted tokens per second of a step of `rung`."""
        plain = 1.0 + (self.lookup_plain if self.chain_now is None else self.chain_now[1])
        if rung.plain:
            return plain / max(self.step_seconds(rung), 1e-9)
        chains = self.lookup_spec if self.chain_found else 0.0  # (no chain now: none to graft)
        chains = chains if self.chain_gain is None else min(chains, self.chain_gain)
        tokens = self.ready * (1.0 + self.expected_accepted(rung) + chains) + (1 - self.ready) * plain
        return tokens / max(self.step_seconds(rung), 1e-9)

    def value(self, rung: Rung) -> float:
        """Predicted tokens per second of choosing `rung` now: its rate, except with overlap, where
        trees come in runs and each run's first step costs what the switch's averages say
        (`costs.run_rate`): from a plain step one switch spread over RUN_STEPS, while trees are
        asked none. Where the last `switch_misses` first asks in a row found no tree (each decoded
        plainly and left the next ask a first one again), DOUBT_MISSES or more, a run is taken to
        begin after 1 + switch_misses more of them: a switch costs its averages that many times
        over, spread over RUN_STEPS, so that a draft whose runs never begin (a random pair's, whose
        pool never holds a plain step's token) is left within some ten asks."""
        if rung.plain or not self.overlap or self.switch_s is None:
            return self.rate(rung)
        t = self.step_seconds(rung)
        k = 1 + self.switch_misses if self.switch_misses >= DOUBT_MISSES else 1
        steps = None if self.asking and k == 1 else RUN_STEPS
        return run_rate(self.rate(rung) * t, t, self.ready, k * self.switch_tokens, k * self.switch_s, steps)

    def see_chain(self, lookup, behind: int = 0) -> None:
        """The chain a step without a tree would verify now (`chain_now`) and whether the context has
        one (`chain_found`), from the request's context lookup (RequestLookup.peek; None: the request
        has none), and the tokens the draft is `behind` on, before a choice."""
        self.chain_now, self.chain_found = (lookup.peek(), lookup.found) if lookup is not None else (None, True)
        self.chain_gain = lookup.gain_now if lookup is not None else None
        self.behind = max(behind, 0)

    def plain_still_best(self, sessions: int) -> bool:
        """Whether the best rung is still a plain step with `sessions` sharing the forwards and the
        chain seen last (see_chain) (choose()'s comparison, without its bookkeeping): asked before a
        run of plain steps ahead follows the last one (plain_ahead.plain_run_co), so that a load
        that makes trees pay ends the run before the next probe."""
        self.sessions = sessions
        return self.best().plain

    def best(self) -> Rung:
        """The rung of the highest predicted tokens per second (the smaller one on a tie): in one pass
        (controller_best.best_rung) where no overlap prices runs; its slow twin is best_slow."""
        if self.overlap and self.switch_s is not None:
            return self.best_slow()
        return best_rung(self)

    def best_slow(self) -> Rung:
        """best's slow twin: value() of every rung."""
        return max(self.rungs, key=lambda r: (self.value(r), -r.nodes, -r.depth))

    def seed_draft(self, ratio: float) -> None:
        """The prior before any tree: the draft's prefill took `ratio` times the target's on the same
        prompt. A draft level costing a target forward or more leaves no tree able to beat a plain
        step, whatever it accepts; from SLOW_DRAFT up the session starts plain, a draft level is
        priced at `ratio` plain forwards until measured, and the first probe is the smallest tree
        (a prior misled by one-off costs, such as a first open's compilation, is corrected by it),
        as late as that tree's price says. Below SLOW_DRAFT the prior is not used (the first tree
        measures the draft, cheaply)."""
        if ratio >= SLOW_DRAFT:
            self.draft_ratio = ratio

    @property
    def priced_by_prior(self) -> bool:
        """No tree has measured the draft yet, and the prior (seed_draft) prices it."""
        return self.draft_ratio is not None and not self.draft.known

    def chain_seconds(self, rows: int) -> float:
        """Predicted forward seconds of a step without a tree that verifies `rows` rows (a chain's
        and its root): the chain steps' own line (`chains`), the context lookup's gate's price."""
        return self.chains(rows)

    def chain_pricing(self) -> dict:
        """RequestLookup's prices from this controller: a chain alone by the chain steps' line, a
        grafted one by the line of every step, and whether the former has measured a chain yet."""
        return dict(cost=self.chain_seconds, graft_cost=self.forward, cost_known=self.chains_priced)

    def chains_priced(self) -> bool:
        """Whether the chain steps' line has told a slope of its own (a chain verified alone)."""
        return self.chains.slope is not None

    def draft_seconds(self, depth: int) -> float:
        """Predicted wait for a tree `depth` deep: the measured line, else the prior (seed_draft)."""
        if not self.priced_by_prior:
            return self.draft(depth)
        a, b = self.forward.line()
        one = self.plain_forward if self.plain_forward is not None else a + b
        return depth * self.draft_ratio * one

    def choose_noted(self, sessions: int = 1) -> Rung:
        """choose(), and the chosen rung's predicted tokens per second added to `predicted` by kind
        (once the warm-up has measured the costs): what the policy expected of each kind of step,
        beside what those steps did (stats.step_kinds)."""
        rung = self.choose(sessions)
        if self.draft.known and self.plain_forward is not None:
            p = self.predicted.setdefault("plain" if rung.plain else "tree", [0.0, 0])
            p[0], p[1] = p[0] + self.rate(rung), p[1] + 1
        return rung

    def begin_step(self) -> None:
        """The forwards recorded before this step (the prefill's, before the first) into the line, not
        into this step's time: choose() calls it, and plain_unchosen()."""
        self._settle()
        self._forward_s, self._rows = 0.0, 0

    def _end_step(self) -> None:
        """The step's forward time becomes its split's (last_forward_s); the next step's starts at 0."""
        self.last_forward_s, self._forward_s, self._rows = self._forward_s, 0.0, 0

    def plain_unchosen(self) -> Rung:
        """PLAIN, for a step decided without the policy (mode lookup, a draft not joined yet), with
        choose()'s bookkeeping (the prefill's forwards are not that step's)."""
        self.begin_step()
        return PLAIN

    def tree_unchosen(self, sessions: int = 1) -> Rung:
        """The best tree rung (the highest predicted tokens per second but plain), for a step the
        batch's governor holds to trees (governor.py), with choose()'s bookkeeping and no probe."""
        self.begin_step()
        self.sessions = sessions
        return max(self.rungs[1:], key=lambda r: (self.value(r), -r.nodes, -r.depth))

    def choose(self, sessions: int = 1) -> Rung:
        """The next step's rung; `sessions` share the target's forwards now."""
        self.begin_step()
        self.sessions = sessions
        if self._probing:  # it found no tree ready (the draft catches up after an unready answer, so
            return self._probe  # the next is likelier), or with overlap began a run: once more
        unsteady = self.overlap and not self.steady  # (overlap) no tree after a tree verified yet
        if self._warm and (self.spec_steps == 0 or unsteady) and self.unready_steps < WARM_TRIES:  # the costs are
            # known: one full tree measures this
            if self._top_may_pay(WARM_MARGIN):  # text's acceptance, every rung's at once
                self._measuring_top = True
                return self.top
            # carried costs say the full tree could win little: no warm-up tree; the best rung, and
            # the probes (spaced by what they could win) are the way back, were the costs to change
            self._warm = False
        if not self._warm:
            tries = self.unready_steps < WARM_TRIES  # an overlapping draft with nothing ready measures nothing
            if self.spec_steps == 0 and self.draft_ratio is None and not self.primed and tries:
                return self.rungs[1]  # the smallest tree first: what a level of drafting costs, cheaply
                # (carried costs know it already: a primed session whose costs say no tree can pay
                # starts plain, and its probes, the smallest tree, are the way back)
            if not self.plain_steps:
                return PLAIN  # one plain step: what a plain forward costs, measured (a verification's is not)
            # (a cold session's second tree; a primed one's is a probe's or the best rung: the full
            # tree after its probe cost a tiny CPU pair's second request 8.8 ms, ~7%, 2026-11-29)
            if (self.spec_steps < self.warmup and not self.primed or unsteady) and self._top_may_pay() and tries:
                self._measuring_top = True
                return self.top
        best = self.best()
        if self.recheck.due(self, best):  # a plain forward measured again (recheck.py)
            return PLAIN
        if best == self.top:  # nothing larger to probe
            self.probe_every = self.since_probe = 0
            return best
        if self.probe_every and self.since_probe < self.probe_every:
            return best  # (no probe due: the probe's rung is not needed, ~25% of a choice's host work)
        probe = self._probe_rung(best)
        if not self.probe_every:  # (with overlap a probe is a run's first step and one more)
            self.probe_every = self.interval(best, probe)
        if self.since_probe >= self.probe_every:
            self._probing, self._best, self._probe, self._probe_by_prior = True, best, probe, self.priced_by_prior
            return probe
        return best

    def _top_may_pay(self, margin: float = 1.0) -> bool:
        """Whether the largest tree could beat a plain step (by `margin`) if every level were
        accepted: when not (a draft far slower than the target), warming up on it would only cost
        time."""
        return self.best_case_rate(self.top) > margin * self.rate(PLAIN)


class AlwaysSpeculate(TreeController):
    """tree_policy=fixed: every step the session's tree (the controller's interface, no decisions)."""

    governed = False  # (a batch's governor never holds it: fixed trees are a benchmark's)

    def choose(self, sessions: int = 1) -> Rung:
        self.begin_step()
        return self.top
