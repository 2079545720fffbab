"""A batch's check on its sessions' own choices: measured rounds with the sessions' choices free,
held to plain steps and held to trees (docs/architecture.md, "Adaptive speculation", the batch's
check).

Each session's policy (controller.py) prices its own step: its share of the forward, its rows, its
draft wait, and what else its step's wall held. In a batched round that last part is the round's
host work, every session's, and it depends on what all of them chose: with every session on trees
the round's host work and draft wait are several times what they are with every session plain
(16 sessions of the 8B geometry on an H200, 2026-12-02: rounds of 37 ms for 4 tokens a session
against 7.5 ms for 1). A session that probes a plain step among trees pays the trees' round and
finds plain steps dear, so a batch can settle on trees where plain steps would decode more (0.76x
batched `ar` there). No per-session price sees that; the batch's own tokens per second do.

The other way holds too: sessions that learnt a plain step's price in plain rounds may stay plain
where trees decode more (8 sessions there: 1,316 tokens/s plain against 1,409 with trees).

`Governor` measures them: while a batch of at least `min_sessions` runs steady rounds (no prompt
chunk, no session joining or leaving), `window` rounds in each regime, the first round after each
switch left out: every session held to plain steps, every session held to trees (the best tree its
policy prices), then the sessions' policies free (`regime`: the driver tells each session's Load;
plain first, so that the rounds of a batch still forming decode as `ar`'s do). The
regime whose rounds' median tokens per second is highest holds for `hold` rounds (the free one
must beat the better held one by `margin`: rounds held to one regime are uniform, while free
sessions mix trees and plain steps in one round, each probe a tree that the whole round waits for;
on an H200, 2026-12-02, the first free windows, mixed, decoded 4-32% less than either uniform
regime), doubling each time a measurement confirms it, and the measurement starts again when the
batch's size changes to another power of two. A measurement costs what its windows of the losing
regimes decode less than the verdict's would have; the hold is long enough that the next
measurement costs at most `budget` of the time (as a session's probes are spaced by what they lose,
costs.probe_interval): sixteen sessions whose trees decode half as much as plain steps hold 154
rounds, not 32. For the same reason no measurement starts in a batch that will not last: where its
sessions' tokens left (their requests' `max_tokens`) end it within `life_factor` measurements' rounds,
its rounds stay free, or held to the verdict it has (eight requests of 64 tokens on the CPU spent half
their time measuring, their windows held to trees opening every session's draft for nothing). A
hold whose own latest rounds decode less than another held regime measured gives way to it
(`_watch`: a window's six rounds can misjudge a regime whose later rounds differ). Where a smaller
batch's latest measurement found trees decoding less than plain steps, a larger batch's measures
its plain steps alone (`trees_lost`): batching shares a plain step's weight reads among more sessions,
while each tree still costs its draft's steps and its verification rows, so trees that lose at four
sessions lose at sixteen (the real pair on an H200, 2026-12-03: trees at 18-56% of plain steps'
rate from 4 to 16 sessions), and so do the sessions' free choices, which mix trees into plain rounds
(free windows at 20-31% of plain's at 8 and 16 sessions of the 1.5B geometry): those windows, their
drafts' opens and slow rounds, were most of what a burst of requests lost. The rounds held while
drafts opened for a trees window count in the measurement's cost (`paid_hold`). `history` keeps the
latest measurements (and revisions) for the summary. Lossless by construction: it only decides
which steps carry trees, as each session's policy does.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger(__name__)

FREE, PLAIN, TREES = "free", "plain", "trees"
# the regimes a measurement runs through, in order: plain steps first, so that a batch's first rounds (the
# sessions joining, their policies' warm-up) decode as `ar` does; the free window last, its sessions'
# policies having priced both kinds of step in the held windows before it
ORDER = (PLAIN, TREES, FREE)
# not a regime of the governor's: the driver's hold for a round held to trees while some session's draft
# still opens (scheduler.Batcher): every session steps plainly, and those without a draft open it, so
# that the opens make no round that mixes trees and plain steps
OPENING = "opening"
HISTORY = 16  # measurements a governor keeps for its summary


def bucket(sessions: int) -> int:
    """The power of two at or above `sessions`: a verdict holds for batches of about one size."""
    return 1 << max(sessions - 1, 0).bit_length()


@dataclass
class Verdict:
    regime: str
    hold: int  # rounds it holds when given
    left: int  # rounds left


@dataclass
class Governor:
    window: int = 6  # steady rounds measured per regime (their median rate: a one-off round, a session's
    # first tree or the draft's catch-up after a hold, does not decide)
    min_sessions: int = 4  # fewer sessions: their own policies decide
    hold: int = 32  # a verdict's first hold in rounds, doubled each time a measurement confirms it
    max_hold: int = 2048
    margin: float = 0.03  # the free regime must decode this much more than the better held one
    budget: float = 0.02  # the share of the time that measuring (its losing windows) may cost
    order: tuple = ORDER  # the regimes a measurement runs through (benchmarks compare orders)
    # a measurement starts only where the batch will keep its size for this many measurements' rounds
    # (round_end's `life`): one that ends sooner would pay for the windows without using the verdict
    life_factor: float = 4.0
    verdicts: dict[int, Verdict] = field(default_factory=dict)  # by batch size (bucket)
    history: list = field(default_factory=list)  # the latest HISTORY measurements: size, rates, verdict
    measured: dict[str, float] = field(default_factory=dict)  # the current measurement's rates (tokens/s)
    phase: Optional[str] = None  # the regime being measured (None: none)
    # by batch size: whether its latest measurement found trees decoding less than plain steps by the
    # margin; a larger batch's measurement then takes its plain window alone (`_regimes`)
    trees_lost: dict[int, bool] = field(default_factory=dict)
    _regimes: tuple = ()  # the current measurement's regimes, in order (self.order, or PLAIN alone)
    _opening: list = field(default_factory=list)  # the current measurement's opening rounds' tokens/s
    _size: int = 0
    _rates: list = field(default_factory=list)  # the measured rounds' tokens per second
    _skip: bool = True  # the next round is a switch's first: not measured
    _t: Optional[float] = None  # perf_counter at the last round's end

    def regime(self, sessions: Optional[int] = None, life: Optional[float] = None) -> str:
        """The next round's regime: FREE (the sessions' own choices), PLAIN or TREES (held).
        `sessions`: the round's (and `life`: Batcher.life); where they make a batch of another size
        than the last round's, the regime its rounds take from the next one on (round_end: FREE below
        `min_sessions`, its verdict while it holds, else a measurement's first regime), so that a
        round that brings a batch to a governed size is held already (its joining sessions start
        held: a session held plain opens no draft, engine_steps). The rounds that follow a change
        are not measured anyway (unsteady)."""
        size = self._size if sessions is None else bucket(sessions) if sessions >= self.min_sessions else 0
        if size != self._size:
            v = self.verdicts.get(size)
            if not size:
                return FREE
            if v is not None and v.left > 0:
                return v.regime
            if not self._measures(size, life):
                return v.regime if v is not None else FREE
            return self._regimes_for(size)[0]
        if self.phase is not None:
            return self.phase
        v = self.verdicts.get(self._size)
        return v.regime if v is not None and v.left > 0 else FREE

    def held(self) -> bool:
        """Whether the next round holds the sessions (to plain steps or to trees)."""
        return self.regime() != FREE

    @property
    def min_life(self) -> int:
        """Rounds a batch must have ahead of it for a measurement to start (`life_factor` measurements)."""
        return math.ceil(self.life_factor * len(self.order) * (self.window + 1))

    def round_end(self, sessions: int, tokens: int, steady: bool, now: Optional[float] = None,
                  life: Optional[float] = None, opening: bool = False, opens_s: float = 0.0) -> None:
        """A round ended: `sessions` in it, `tokens` they emitted, `steady` (no prompt chunk, no
        session joined or left); `life`: the rounds the batch keeps its size if no session joins (at
        most its sessions' tokens left: Batcher.life; None: unknown, as long as need be); `opening`:
        a round held to trees stepped plainly while drafts opened (OPENING: part of the measurement's
        cost, paid_hold); `opens_s`: the expected seconds of the draft opens that a trees window would
        start (Batcher.opens_s: the sessions' deferred opens), which the batch's life must pay for
        (`_opens_pay`) or its measurement ends with its plain window."""
        now = time.perf_counter() if now is None else now
        seconds, self._t = (now - self._t if self._t is not None else None), now
        size = bucket(sessions) if sessions >= self.min_sessions else 0
        if size != self._size:  # another batch size (or too few sessions): what was measured is not its
            self._size, self.phase, self.measured = size, None, {}
            self._restart()
        if not size:
            return
        v = self.verdicts.get(size)
        if self.phase is None:
            before = FREE  # the regime of the rounds before the measurement
            if v is not None and v.left > 0:
                v.left -= 1
                if v.left:
                    self._watch(v, tokens, seconds, steady)
                    return
                before = v.regime
            if not self._measures(size, life):  # (it would end before a verdict paid its windows)
                if v is not None:
                    v.left = 1  # (the verdict holds on, round by round, while the batch lasts)
                return
            self._regimes = self._regimes_for(size)
            self.phase, self.measured, self._opening = self._regimes[0], {}, []
            self._restart()
            self._skip = before != self.phase  # (a run ahead, or a tree, may end in the next round)
            return
        if opening and seconds is not None:
            self._opening.append(tokens / max(seconds, 1e-9))
        if not steady or seconds is None:
            self._restart()
            return
        if self._skip:  # (the switch's first round: steps of the other regime still in it)
            self._skip = False
            return
        self._rates.append(tokens / max(seconds, 1e-9))
        if len(self._rates) < self.window:
            return
        self.measured[self.phase] = statistics.median(self._rates)
        self._restart()
        skipped = self.phase == PLAIN and len(self._regimes) > 1 and not self._opens_pay(sessions, life, opens_s)
        if skipped:  # (the trees window's opens would cost more than the batch can win back: plain, measured)
            self._regimes = (PLAIN,)
        if self.phase != self._regimes[-1]:
            self.phase = self._regimes[self._regimes.index(self.phase) + 1]
            return
        regime = max((r for r in (PLAIN, TREES) if r in self.measured), key=self.measured.get)
        if FREE in self.measured and self.measured[FREE] > (1 + self.margin) * self.measured[regime]:
            regime = FREE
        if TREES in self.measured:
            self.trees_lost[size] = self.measured[TREES] < (1 - self.margin) * self.measured[PLAIN]
        hold = min(2 * v.hold, self.max_hold) if v is not None and v.regime == regime else self.hold
        hold = max(hold, min(self.paid_hold(regime), self.max_hold))
        self.verdicts[size] = Verdict(regime, hold, hold)
        rates = {r: round(x, 1) for r, x in self.measured.items()}  # tokens/s by regime
        entry = dict(size=size, rates=rates, regime=regime, hold=hold)
        if self._opening:
            entry["opening"] = len(self._opening)  # (rounds held while drafts opened)
        if skipped:
            entry["skipped_opens_s"] = round(opens_s, 3)  # (no trees window: its opens would not pay)
        self.history = self.history[-(HISTORY - 1):] + [entry]
        log.info("batch governor: %d sessions decoded %s tokens/s -> %s for %d rounds", size,
                 " / ".join(f"{r} {rates[r]:.0f}" for r in self._regimes), regime, hold)
        self.phase = None

    def _lost(self, size: int) -> bool:
        """Trees lost in a smaller batch: they lose here too (batching shares a plain step's weights
        among more sessions, while each tree still costs its draft steps and its rows), and so do the
        sessions' free choices, which mix trees and chains into plain rounds."""
        return any(x for n, x in self.trees_lost.items() if n < size)

    def _regimes_for(self, size: int) -> tuple:
        """A measurement's regimes in a batch of `size`, in order: its plain window alone where trees lost
        in a smaller batch (`_lost`), else `order`."""
        return (PLAIN,) if self._lost(size) else self.order

    def _measures(self, size: int, life: Optional[float]) -> bool:
        """Whether a measurement starts in a batch of `size` with `life` rounds ahead (None: unknown);
        a plain window alone (`_lost`) costs nothing against its verdict: measured however short."""
        return life is None or life >= self.min_life or self._lost(size)

    def _opens_pay(self, sessions: int, life: Optional[float], opens_s: float) -> bool:
        """Whether the windows after the plain one may open the sessions' drafts: their expected seconds
        (`opens_s`), in rounds of the plain window's rate (a plain round: a token a session), with the
        windows left, are at most the batch's `life` over `life_factor`, as a measurement's own rounds
        are (`_measures`). On one GPU an open is a draft prefill of the session's prompt that the rounds
        wait for (Batcher.wait_opens): four sessions of 16K prompts with the 0.5B draft on an H200 opened
        for 0.8 s in a burst whose 256 tokens took 0.6 s plainly (2026-12-03)."""
        if opens_s <= 0.0 or life is None:
            return True
        round_s = sessions / max(self.measured[PLAIN], 1e-9)
        left = (len(self._regimes) - 1) * (self.window + 1)
        return life >= self.life_factor * (left + opens_s / round_s)

    def _watch(self, v: Verdict, tokens: int, seconds: Optional[float], steady: bool) -> None:
        """A held round: where the hold's own latest `2 * window` steady rounds decode less than the best
        other held regime measured by the margin, that regime holds instead (for `hold` rounds). A window of
        six rounds can misjudge a regime whose later rounds differ from its first (the sessions' trees
        grow as their policies learn their prices): sixteen sessions held to trees measured at 2,155
        tokens/s then decoded 1,714 for the rest of the hold (H200, 2026-12-02). It gives way to a held
        regime only, never to the sessions' free choices: their window's rate holds for as long as what
        they learnt in the held windows before it (four sessions of the 1.5B geometry held plain at
        1,742 tokens/s gave way to a free window's 1,797, and the batch then decoded at 0.44x `ar`:
        H200, 2026-12-03)."""
        if not steady or seconds is None:
            return
        if self._skip:  # (the hold's first round: steps of the measurement's last regime still in it)
            self._skip = False
            return
        self._rates = (self._rates + [tokens / max(seconds, 1e-9)])[-2 * self.window:]
        others = {r: x for r, x in self.measured.items() if r not in (v.regime, FREE)}  # (held regimes only)
        if len(self._rates) < 2 * self.window or not others:
            return
        rate, (best, other) = statistics.median(self._rates), max(others.items(), key=lambda kv: kv[1])
        if rate >= (1 - self.margin) * other:
            return
        self.measured[v.regime] = rate
        self.verdicts[self._size] = Verdict(best, self.hold, self.hold)
        rates = {r: round(x, 1) for r, x in self.measured.items()}
        self.history = self.history[-(HISTORY - 1):] + [dict(size=self._size, rates=rates, regime=best, hold=self.hold,
                                                             revised=v.regime)]
        log.info("batch governor: %d sessions held to %s decoded %.0f tokens/s, less than %s's %.0f -> %s for %d rounds",
                 self._size, v.regime, rate, best, other, best, self.hold)
        self._restart()

    def paid_hold(self, regime: str) -> int:
        """Rounds to hold `regime` so that a measurement like the last one costs at most `budget` of
        the time: each window (its skipped round too) of a regime that decodes less than `regime` loses
        that share of its rounds, and so does each round held while drafts opened for the trees window
        (a one-GPU pair's draft prefills its prompts beside the target's rounds)."""
        best = max(self.measured[regime], 1e-12)
        lost = sum((self.window + 1) * max(0.0, 1.0 - rate / best) for rate in self.measured.values())
        lost += sum(max(0.0, 1.0 - rate / best) for rate in self._opening)
        return math.ceil(lost / self.budget - 1e-9) - len(self.measured) * (self.window + 1) - len(self._opening)

    def _restart(self) -> None:
        self._rates, self._skip = [], True

    def summary(self) -> dict:
        """The verdicts by batch size (benchmarks): regime, hold and rounds left; and under "history"
        the latest measurements (each regime's tokens per second and the verdict)."""
        out: dict = {n: dict(regime=v.regime, hold=v.hold, left=v.left) for n, v in sorted(self.verdicts.items())}
        if self.history:
            out["history"] = list(self.history)
        return out
