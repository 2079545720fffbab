"""What a session measures of the machine's and the models' costs (docs/architecture.md, "Adaptive
speculation"): a cost line fitted online, and the costs a finished session leaves for the next."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional

# With an overlapping draft, the tree steps a run of them is expected to last once begun: a tree
# chosen after a plain step pays the run's first step (the switch) once over them ...
RUN_STEPS = 8
STAY_MARGIN = 0.05  # ... and trees asked lately are left only for a plain rate this much above theirs
# A point above this many times what its line predicts counts as this many times: a one-off (a
# shape's first forward, a graph capture, a collector's pause) moves the line as a slow point does,
# not by its whole size; a real change of cost still moves it, by up to this factor a point
OUTLIER = 4.0


class LinearCost:
    """cost(x) = a + b x: least squares over exponentially weighted (x, y) points (the newest
    weighs `alpha`). While the points seen lately are too alike in x to tell a slope, it keeps the
    last slope it could tell; before any, the `prior` line's slope (where it has one: another
    kind of point, e.g. the prefill's chunks for the decode steps' forwards), else b = 0 (flat) or,
    `proportional`, a = 0. Before any point, the prior's line. With `clip` (forwards' lines:
    OUTLIER), once it has points a new one counts as at most `clip` times what the line predicts
    for it (a weighted least-squares fit gives one far point leverage over the slope for tens of
    points); waits, a mixture of short and long ones whose mean is the price, are not clipped."""

    def __init__(self, alpha: float = 0.1, proportional: bool = False, prior: Optional["LinearCost"] = None,
                 clip: Optional[float] = None) -> None:
        self.alpha, self.proportional, self.prior, self.clip = alpha, proportional, prior, clip
        self.sums = [0.0] * 5  # weighted sums of 1, x, x^2, y, x y
        self.slope: Optional[float] = None  # the last slope the points could tell

    @property
    def known(self) -> bool:
        return self.sums[0] > 0

    def clipped(self, x: float, y: float) -> float:
        """`y` as a point at `x` counts: with `clip`, once the line has points, at most `clip` times
        what it predicts (docs/architecture.md, "Adaptive speculation": one-offs)."""
        if self.clip is not None and self.known:
            return min(y, self.clip * max(self(x), 1e-12))
        return y

    def add(self, x: float, y: float) -> None:
        y = self.clipped(x, y)
        a = self.alpha
        self.sums = [(1 - a) * s + a * v for s, v in zip(self.sums, (1.0, x, x * x, y, x * y))]
        w, sx, sxx, sy, sxy = self.sums
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var > 1e-4 * mx * mx:  # x spread of at least 1% of its mean
            self.slope = max((sxy / w - mx * my) / var, 0.0)

    def line(self) -> tuple[float, float]:
        """(a, b); before any point the prior's, else (0, 0)."""
        w, sx, _, sy, _ = self.sums
        if not w:
            return self.prior.line() if self.prior is not None else (0.0, 0.0)
        mx, my = sx / w, sy / w
        b = self.slope
        if b is None and self.prior is not None:
            b = self.prior.slope
        if b is None:
            b = my / mx if self.proportional and mx else 0.0
        return max(my - b * mx, 0.0), b

    def __call__(self, x: float) -> float:
        a, b = self.line()
        return a + b * x


def run_rate(tokens: float, seconds: float, ready: float, switch_tokens: float, switch_s: float,
             steps: Optional[int]) -> float:
    """Tokens per second of a tree rung whose steps inside a run yield `tokens` in `seconds` (the
    ready and unready answers mixed by the `ready` share) where each unready answer ends the run and
    the next tree begins one, at `switch_tokens` in `switch_s` (docs/architecture.md, "Adaptive
    speculation"). From outside a run one more first step, spread over `steps` steps; inside one
    (`steps` None), the rate over 1 - STAY_MARGIN (leaving costs a switch later)."""
    f = 1.0 - ready  # first steps per step inside a run
    tokens, seconds = tokens + f * switch_tokens, seconds + f * switch_s
    if steps is not None:
        n = steps - 1
        return (switch_tokens + n * tokens) / max(switch_s + n * seconds, 1e-9)
    return tokens / max(seconds, 1e-9) / (1 - STAY_MARGIN)


def probe_interval(t_probe: float, t_best: float, rate_probe: float, rate_best: float, min_probe: int,
                   ratio: float, gain: Optional[float] = None) -> int:
    """Steps between probes so that they lose about 1/`ratio` of the time: a probe loses its time
    (`t_probe`) less the time its predicted tokens take at the best rung's rate; the best step takes
    `t_best`. A probe that drafts on the target's path loses most of its time (the 0.5B draft beside
    the 1.5B on one GPU: ~30 steps apart); a ready tree from an overlapping draft, little (every few
    steps), so that its trees are measured again.

    `gain`: the most the probed rung could beat the best by, as a share of the best's rate (its
    rate were every level accepted, over the best's, less 1). A probe can reveal at most that much a
    step, so probes are also at least `lost / (gain * t_best)` steps apart: exploring never costs
    more than it could win (a draft that could pay 5% at best, probed with trees ten plain steps
    long, is probed every ~200 steps, not every ~20). With no gain possible, `sys.maxsize`."""
    lost = t_probe * max(1.0 - rate_probe / max(rate_best, 1e-12), 0.0)
    steps = ratio * lost / max(t_best, 1e-9)
    if gain is not None:
        if gain <= 0:
            return sys.maxsize
        steps = max(steps, lost / (gain * max(t_best, 1e-9)))
    return max(min_probe, int(steps + 0.5))


def probe_cap(t_probe: float, t_best: float, min_probe: int, every_s: float, share: float) -> int:
    """The most steps between probes: a probe at least every `every_s` seconds of best steps
    (`t_best` each), so that costs that changed since the interval was set (a batch that shrank,
    costs carried from a session that decoded under load) are found out within seconds, not 1,024
    steps; but never so often that probes (`t_probe` each, at most what one loses) take more than
    `share` of the time. An infinite `every_s`: no cap (sys.maxsize)."""
    if math.isinf(every_s):
        return sys.maxsize
    return max(min_probe, math.ceil(max(every_s, t_probe / share) / max(t_best, 1e-9)))


@dataclass(frozen=True)
class Costs:
    """What a finished session of the same engine measured of the costs (the machine's and the
    models', not the text's), for the next session to start from instead of the warm-up steps that
    measure them (TreeController.costs / start_from; docs/architecture.md, "Adaptive speculation")."""

    forward: LinearCost
    draft: LinearCost
    plain_forward: float
    extra_spec: Optional[float]
    extra_plain: Optional[float]
    # the probe schedule goes on across sessions: steps since the last probe and the interval, so
    # that requests shorter than the interval still probe now and then (the way back for a draft
    # whose costs changed: sessions that never probe would carry the same costs for good)
    since_probe: int = 0
    probe_every: int = 0
    chains: Optional[LinearCost] = None  # the forwards of steps without a tree (TreeController.chains)
    catchup: Optional[LinearCost] = None  # the draft's catch-up before a tree after them (TreeController.catchup)
    since_plain: int = 0  # the plain rechecks' schedule (recheck.PlainRecheck), going on as the probes' does
    plain_every: int = 0
