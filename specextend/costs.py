"""What a session measures of the machine's and the models' costs (docs/architecture.md, "Adaptive
speculation"): a cost line fitted online, and the costs a finished session leaves for the next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class LinearCost:
    """cost(x) = a + b x: least squares over exponentially weighted (x, y) points (the newest
    weighs `alpha`). While the points seen lately are too alike in x to tell a slope, it keeps the
    last slope it could tell; before any, b = 0 (flat) or, `proportional`, a = 0."""

    def __init__(self, alpha: float = 0.1, proportional: bool = False) -> None:
        self.alpha, self.proportional = alpha, proportional
        self.sums = [0.0] * 5  # weighted sums of 1, x, x^2, y, x y
        self.slope: Optional[float] = None  # the last slope the points could tell

    @property
    def known(self) -> bool:
        return self.sums[0] > 0

    def add(self, x: float, y: float) -> None:
        a = self.alpha
        self.sums = [(1 - a) * s + a * v for s, v in zip(self.sums, (1.0, x, x * x, y, x * y))]
        w, sx, sxx, sy, sxy = self.sums
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var > 1e-4 * mx * mx:  # x spread of at least 1% of its mean
            self.slope = max((sxy / w - mx * my) / var, 0.0)

    def line(self) -> tuple[float, float]:
        """(a, b); (0, 0) before any point."""
        w, sx, _, sy, _ = self.sums
        if not w:
            return 0.0, 0.0
        mx, my = sx / w, sy / w
        b = self.slope if self.slope is not None else (my / mx if self.proportional and mx else 0.0)
        return max(my - b * mx, 0.0), b

    def __call__(self, x: float) -> float:
        a, b = self.line()
        return a + b * x


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
