"""The adaptive policy's way back to plain steps: a plain step now and then while trees are chosen,
so that a plain forward once measured slow is measured again (docs/architecture.md, "Adaptive
speculation", *Rechecks*).

Probes are the way back to trees: a tree measured once as costing too much is tried again, spaced
by what the try could lose. Without rechecks nothing was the way back to plain steps: a session whose
one plain step was timed slow (a noisy CPU: 1.47 ms where plain steps take 0.75-0.8) priced every
plain step at that, and where trees then looked better it took no plain step that would correct
it; the carried costs handed the price on to the next session (the tiny pair replayed at 5 on a
CPU: trees every step at half `ar`'s rate, 2026-11-29). A recheck is one plain step, its forward timed
alone (never a run of plain steps ahead, whose readings are a run's intervals), taken where trees are best once the
steps since the last plain step reach an interval set as a probe's is (costs.probe_interval:
about a tenth of the time lost against the best rung) and doubled after each recheck that leaves a
tree the best, up to the controller's `max_probe`; its reading replaces the plain forward's price
(the reading in question is the one it rechecks). The schedule goes on across sessions with the
carried costs, as the probes' does. Only a session alone on its forwards, without overlap: the
plain forward's own price is used only there (a batch prices plain steps by the forwards' line).
And only while the reading is in doubt: none where the plain forward costs no more than the best
tree's verification forward (a forward of more rows, its line: so the reading is not a slow outlier)
and the best tree's predicted rate is PLAIN_DOUBT times the plain step's or more (the plain step
could only be best were its reading that far off). There a recheck only lost a step: the 8B
geometry replayed at 5 on an H200 took one of 5.5 ms for 1 token in a 22-step answer whose trees
made 6 in 8.2 ms (~2% of its time, 2026-11-30). The slow reading above was 1.9x and above the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specextend.costs import probe_interval
from specextend.ladder import PLAIN, Rung

# a plain step's measured rate times this below the best tree's, and its forward within the tree's
# verification line: no recheck
PLAIN_DOUBT = 2.0

if TYPE_CHECKING:
    from specextend.controller import TreeController


@dataclass
class PlainRecheck:
    since: int = 0  # steps since the last plain step (any: chosen, a run's, a recheck)
    every: int = 0  # 0: to be set from the costs when a recheck is next considered
    pending: bool = False  # the step just chosen is a recheck (no run of plain steps ahead from it)
    done: int = 0  # rechecks taken (this session)

    def due(self, ctl: "TreeController", best: Rung) -> bool:
        """Whether the step about to be chosen, `best` a tree, is a recheck instead (and then it is
        pending until its plain step is recorded)."""
        if best.plain or ctl.overlap or ctl.sessions > 1 or ctl.plain_forward is None:
            return False
        if ctl.plain_forward <= ctl.forward(best.nodes + 1) and PLAIN_DOUBT * ctl.value(PLAIN) < ctl.value(best):
            return False  # not in doubt (the steps since go on counting: a recheck comes once it is)
        if not self.every:
            self.every = min(probe_interval(ctl.step_seconds(PLAIN), ctl.step_seconds(best), ctl.value(PLAIN),
                                            ctl.value(best), ctl.min_probe, ctl.probe_ratio), ctl.max_probe)
        self.pending = self.since >= self.every
        return self.pending

    def plain_step(self) -> bool:
        """A plain step was recorded; whether it was a recheck (its reading replaces the price)."""
        was, self.pending, self.since = self.pending, False, 0
        self.done += was
        return was

    def after(self, ctl: "TreeController") -> None:
        """After a recheck's reading is in: a tree still best doubles the interval; a plain step
        best now sets it anew from the costs when trees are next chosen."""
        self.every = 0 if ctl.best().plain else min(2 * self.every, ctl.max_probe)

    def tree_step(self) -> None:
        self.since += 1
