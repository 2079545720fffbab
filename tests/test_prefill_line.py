"""The prefill's forwards price the steps only until the steps' own forwards tell a line
(controller_record.record_prefill, costs.LinearCost's prior; docs/architecture.md, "Adaptive
speculation")."""

import pytest

from specextend.config import TreeConfig
from specextend.controller import TreeController
from specextend.costs import LinearCost
from specextend.ladder import ladder


def test_a_line_without_points_or_slope_takes_its_priors():
    prior = LinearCost()
    line = LinearCost(prior=prior)
    assert line.line() == (0.0, 0.0)
    prior.add(100, 0.030)
    prior.add(2100, 0.090)  # 30 us a row
    assert line.line() == prior.line() and not line.known  # no point of its own: the prior's line
    line.add(5, 0.005)  # one x: no slope of its own, the prior's, through its own point
    a, b = line.line()
    assert b == pytest.approx(3e-5) and a + 5 * b == pytest.approx(0.005)
    line.add(33, 0.006)  # two x: its own slope, whatever the prior says
    assert line.line()[1] == pytest.approx((0.006 - 0.005) / 28, rel=0.2)


def test_the_prefill_does_not_set_the_steps_slope():
    """As measured on an H200 (8B geometry, 8K prompt after a prefix-cache hit): the 100-row tail
    chunk eager at 30 ms, a 5-row verify 5.25 ms, 33 rows 6.2 ms. With the chunk in the steps'
    line a 33-row tree was priced 12 ms; in the prefill's own line, the steps' line is their own."""
    ctl = TreeController(ladder(TreeConfig(32, 6, 4)))
    ctl.record_prefill(2048, 0.084)
    ctl.record_prefill(100, 0.030)
    ctl.begin_step()
    for rows, s in [(5, 0.00525), (1, 0.00513), (33, 0.0062)] + [(5, 0.00525)] * 10:
        ctl.record_forward(rows, s)
        ctl.begin_step()
    assert ctl.forward(33) == pytest.approx(0.0062, rel=0.05)  # (0.0124 with the chunk as a point)
    assert ctl.forward(5) == pytest.approx(0.00525, rel=0.05)
    assert ctl.prefill.known and ctl.prefill(100) == pytest.approx(0.030, rel=0.01)


def test_before_its_first_step_a_session_is_priced_by_its_prefill():
    ctl = TreeController(ladder(TreeConfig(16, 6, 4)))
    ctl.record_prefill(512, 0.020)
    ctl.record_prefill(64, 0.006)
    ctl.begin_step()
    assert not ctl.forward.known and ctl.forward(9) == pytest.approx(0.006 - 55 * 0.014 / 448)
