"""costs.LinearCost, the cost lines the adaptive policy fits online (docs/architecture.md,
"Adaptive speculation"): a slope told and kept, a proportional line, one-offs among forwards."""

import pytest

from specextend.costs import OUTLIER, LinearCost


def test_linear_cost():
    fit = LinearCost(alpha=0.2)
    assert fit.line() == (0.0, 0.0) and not fit.known
    fit.add(17, 0.0185)
    assert fit.line() == pytest.approx((0.0185, 0.0))  # one size seen: flat
    for x in (1, 17, 9, 1, 33):
        fit.add(x, 0.01 + 0.0005 * x)
    a, b = fit.line()
    assert a == pytest.approx(0.01) and b == pytest.approx(0.0005)
    for _ in range(200):  # one size only for a long time: the slope it could tell is kept
        fit.add(17, 0.01 + 0.0005 * 17)
    assert fit.line()[1] == pytest.approx(0.0005) and fit(1) == pytest.approx(0.0105)
    prop = LinearCost(proportional=True)
    prop.add(6, 0.012)
    assert prop(3) == pytest.approx(0.006)  # one depth seen: cost per level


def test_a_forward_line_takes_a_one_off_as_a_slow_point():
    """A shape's first forward (a capture: ~250x a step) among steps of 1 and 9 rows: the forwards'
    line (clip=OUTLIER) keeps its slope; unclipped, the fit's slope says a row costs more than a
    whole step for tens of steps. A real change of cost (every forward 3x) is followed all the same."""
    def fed(line, points):
        for x, y in points:
            line.add(x, y)
        return line

    steady = [(1, 0.002), (9, 0.0021)] * 10
    one_off = steady + [(9, 0.5)] + steady[:6]
    clipped, raw = fed(LinearCost(clip=OUTLIER), one_off), fed(LinearCost(), one_off)
    assert clipped.line()[1] < 0.0003 and clipped(1) > 0.0015
    assert raw.line()[1] * 8 > 0.002  # (the rows beyond the first priced above a whole step)
    changed = fed(LinearCost(clip=OUTLIER), steady + [(x, 3 * y) for x, y in steady * 3])
    assert changed(1) == pytest.approx(0.006, rel=0.05) and changed(9) == pytest.approx(0.0063, rel=0.05)
    waits = fed(LinearCost(), [(4, 0.0001)] * 10 + [(4, 0.01)])  # (a wait's line: its mean is the price)
    assert waits(4) > 0.0009
