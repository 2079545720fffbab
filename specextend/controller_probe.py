"""When the adaptive policy probes and with what: the probing half of controller.TreeController (a
mixin: the state is the controller's dataclass fields; docs/architecture.md, "Adaptive
speculation", *Probes spaced by what they could win*). The choosing half is controller.py."""

from __future__ import annotations

from specextend.costs import probe_cap, probe_interval
from specextend.ladder import Rung


class Probing:
    """TreeController's interval() / probe_seconds() / probe_cap() / _probe_rung() / best_case_rate()."""

    def interval(self, best: Rung, probe: Rung, at_least: int = 0) -> int:
        """Steps between probes of `probe` while `best` is chosen (costs.probe_interval), or
        `at_least` (a doubled schedule) where that is more, within max_probe and the cap in seconds
        (probe_cap): what the probe could win bounds how often it is worth trying, once the draft is
        measured (a prior's price is a guess that the probe is there to correct); a probe that waits
        for a deferred draft open costs that open too (open_s)."""
        gain = None if self.priced_by_prior else self.best_case_rate(probe) / max(self.value(best), 1e-12) - 1.0
        t_probe, t_best = self.probe_seconds(probe), self.step_seconds(best)
        steps = probe_interval(t_probe, t_best, self.value(probe), self.value(best), self.min_probe,
                               self.probe_ratio, gain)
        return min(max(at_least, steps), self.max_probe, self.probe_cap(t_probe, t_best))

    def probe_seconds(self, probe: Rung) -> float:
        """What a probe of `probe` costs: its step, a switch, a deferred draft open (open_s)."""
        return self.step_seconds(probe) + (self.switch_s or 0.0) + self.open_s

    def probe_cap(self, t_probe: float, t_best: float) -> int:
        """The most steps between probes (costs.probe_cap): one at least every `probe_every_s`
        seconds, but losing at most a fiftieth of the time (five times the interval's 1/probe_ratio)."""
        return probe_cap(t_probe, t_best, self.min_probe, self.probe_every_s, 1.0 / (5 * self.probe_ratio))

    def _probe_rung(self, best: Rung) -> Rung:
        """The rung a probe takes while `best` is chosen: while only the prior prices the draft, the
        smallest tree (a level measured cheaply corrects a wrong prior); after it the largest rung
        whose best case (every level accepted) beats `best` (it measures every rung inside it), else
        the smallest (it re-measures the draft)."""
        if self.priced_by_prior:
            return self.rungs[1]
        bar = self.value(best)
        return next((r for r in reversed(self.rungs[1:]) if self.best_case_rate(r) > bar), self.rungs[1])

    def best_case_rate(self, rung: Rung) -> float:
        """Tokens per second of a step of `rung` were every level of its tree accepted: an upper bound."""
        return (1.0 + rung.depth) / max(self._verified_seconds(rung), 1e-9)
