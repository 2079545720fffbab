"""What a finished session hands the engine's next one, and what the next takes from it: the carrying
half of controller.TreeController (a mixin: the state is the controller's dataclass fields;
docs/architecture.md, "Adaptive speculation"). The choosing half is controller.py, the recording
half controller_record.py."""

from __future__ import annotations

import copy
from typing import Optional

from specextend.costs import Costs
from specextend.ladder import PLAIN
from specextend.recheck import PlainRecheck

# A session started from carried costs warms up on the full tree (one step measures the text's
# acceptance for every rung) only where that tree, fully accepted, would beat a plain step by this
# much: where it could win little, a tree ten plain steps long is a poor bet on a short request
# (the tiny pair on 2 CPUs: three such trees took a 128-token request to 0.6x `ar`); the probes, spaced
# by what they could win (costs.probe_interval), find out instead
WARM_MARGIN = 1.25


class Carrying:
    """TreeController's costs() / start_from() / first_tree_in()."""

    def costs(self) -> Optional[Costs]:
        """This session's costs for the engine's next session: None unless it measured those the
        warm-up measures (a draft level's wait, a plain forward)."""
        if not (self.draft.known and self.plain_forward is not None):
            return None
        return Costs(copy.deepcopy(self.forward), copy.deepcopy(self.draft), self.plain_forward, self.extra_spec,
                     self.extra_plain, self.since_probe, self.probe_every, copy.deepcopy(self.chains),
                     copy.deepcopy(self.catchup), self.recheck.since, self.recheck.every)

    def start_from(self, costs: Costs) -> None:
        """Start from an earlier session's costs: no smallest tree and plain step to measure them,
        the first step the full tree (it measures this text's acceptance for every rung at once)
        where it could win `WARM_MARGIN` fully accepted; else the best rung, and the probe schedule
        carried on from where the last session left it (its probes, spaced by what they could win,
        are how a draft whose costs changed gets tried again). This session's own forwards and
        waits join the lines at their rates."""
        self.forward, self.draft = copy.deepcopy(costs.forward), copy.deepcopy(costs.draft)
        self.forward.prior = self.prefill  # (this session's prefill)
        if costs.chains is not None:
            self.chains = copy.deepcopy(costs.chains)
        self.chains.prior = self.forward
        if costs.catchup is not None:
            self.catchup = copy.deepcopy(costs.catchup)
        self.plain_forward, self.extra_spec, self.extra_plain = costs.plain_forward, costs.extra_spec, costs.extra_plain
        self.since_probe, self.probe_every = costs.since_probe, min(costs.probe_every, self.max_probe)
        self.recheck = PlainRecheck(costs.since_plain, min(costs.plain_every, self.max_probe))
        self.primed = self._warm = True

    def price_open(self, open_s: float) -> None:
        """This primed session's draft is not open and its open would wait for its next probe
        (draft_link.DraftLink.defers_open): that probe costs the open as well (`open_s`, the
        expected seconds of the draft's prefill, which then runs beside the target's steps for the
        probe's sake), so the carried schedule, set from earlier costs and doubled since, is raised
        to at least the interval that this session's costs give with the open added to the probe
        (`interval`, within max_probe): where no probe could win, max_probe. An interval set from
        here on counts the open too (open_s) until the draft has joined (no_open)."""
        self.open_s = max(open_s, 0.0)
        self.first_tree_in()  # (settles the warm-up decision)
        if not self.primed or self._warm or not self.probe_every or self._probing:
            return  # (choose() sets the interval, with the open's seconds)
        best = self.best()
        if best != self.top:
            self.probe_every = max(self.probe_every, self.interval(best, self._probe_rung(best)))

    def no_open(self) -> None:
        """The draft has joined: probes cost no open from now on."""
        self.open_s = 0.0

    def first_tree_in(self) -> int:
        """Steps before this session could first choose a tree (0: at once, or not known): a primed
        session that skips the warm-up tree takes none before its next probe (it has measured no
        acceptance of its own): what a deferred draft open waits for (draft_link.DraftLink.defers_open)."""
        if self._warm and self.primed and not self._top_may_pay(WARM_MARGIN):
            self._warm = False  # (choose()'s decision at the first step, made once here: asked every step)
        if not self.primed or not self.probe_every or self._warm:
            return 0
        return max(self.probe_every - self.since_probe, 0)

    def priced(self) -> dict:
        """What the policy believes now, in milliseconds (benchmarks' rows: a choice can be read
        against its prices): a plain step's forward and host work, the steps' forward line (a + b
        rows), the chain steps' and a draft level's, the predicted seconds of a plain step and of the
        full tree, and the probe schedule. A plain step priced at zero (an e2e run of the real pair on
        an H200, 2026-11-30: the policy predicted 1e9 tokens/s for its plain steps and took no tree)
        shows which of them said so. `rows`: each tree size's verification residual over the line (rows_price)."""
        def ms(x: Optional[float]) -> Optional[float]:
            return None if x is None else 1e3 * x

        def line(cost) -> list:
            a, b = cost.line()
            return [1e3 * a, 1e3 * b]

        return dict(plain_forward=ms(self.plain_forward), extra_plain=ms(self.extra_plain),
                    extra_spec=ms(self.extra_spec), forward=line(self.forward), chains=line(self.chains),
                    draft=line(self.draft), prefill=line(self.prefill), plain_step=ms(self.step_seconds(PLAIN)),
                    top_step=ms(self.step_seconds(self.top)), probe_every=self.probe_every,
                    since_probe=self.since_probe, primed=self.primed,
                    rows={str(r): 1e3 * v for r, (v, n) in sorted(self.rows_price.items())})  # (residuals)
