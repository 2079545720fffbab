"""A tree size's own price (TreeController.rows_price): where a GEMM's cost is flat in rows, the line
a + b rows overprices a larger tree that costs the same as a smaller one, and the policy takes the
smaller tree, which accepts less; once two verifications of a size are measured, the line plus that
size's residual prices it (docs/architecture.md, "Adaptive speculation")."""

from pytest import approx

from specextend.config import TreeConfig
from specextend.controller import ROW_MIN, TreeController
from specextend.ladder import Rung, ladder

SMALL, LARGE = Rung(4, 3), Rung(8, 3)


def flat_gemm_controller() -> TreeController:
    """Costs as the 8B geometry's verify at 16K on an H200 (5 and 9 rows alike, 33 dearer), a
    draft level's wait, and the 8-node tree accepting a little more than the 4-node one."""
    ctl = TreeController(ladder(TreeConfig(8, 3, 4)))
    for _ in range(10):
        ctl.forward.add(5, 5.7e-3)
    for _ in range(3):
        ctl.forward.add(33, 7.5e-3)
    ctl.draft.add(3, 2.0e-3)
    ctl.plain_forward, ctl.extra_spec, ctl.extra_plain = 5.0e-3, 0.0, 0.0
    ctl.accepted = {SMALL: 2.9, LARGE: 3.0}
    return ctl


def verify(ctl: TreeController, rung: Rung, seconds: float) -> None:
    """One step of `rung` recorded as the engine records it: its forward, then the step."""
    ctl.begin_step()
    ctl.record_forward(rung.nodes + 1, seconds)
    ctl.record_spec(rung, 2.0e-3, {rung: ctl.accepted[rung]}, step_s=seconds + 2.0e-3)


def price(ctl: TreeController, rung: Rung) -> float:
    a, b = ctl.forward.line()
    return ctl.forward_seconds(rung.nodes + 1, a, b)


def test_the_line_alone_takes_the_smaller_tree():
    ctl = flat_gemm_controller()
    assert price(ctl, LARGE) > price(ctl, SMALL) + 1e-4  # the line prices the 4 extra rows
    assert ctl.best() == SMALL


def test_measured_sizes_are_priced_by_what_they_cost():
    ctl = flat_gemm_controller()
    for _ in range(3 * ROW_MIN):
        verify(ctl, SMALL, 5.7e-3)
        verify(ctl, LARGE, 5.7e-3)
    assert price(ctl, LARGE) == approx(5.7e-3, abs=5e-5) and price(ctl, SMALL) == approx(5.7e-3, abs=5e-5)
    assert ctl.best() == LARGE  # the same cost, more accepted


def test_a_residual_follows_the_line_as_the_context_grows():
    """The line moves with every forward (a longer context costs more); a size's residual is its
    shape against the line, so its price moves with it."""
    ctl = flat_gemm_controller()
    for _ in range(ROW_MIN):
        verify(ctl, LARGE, 5.7e-3)
    before = price(ctl, LARGE)
    for _ in range(30):  # every forward 1 ms dearer (plain steps' and the small tree's)
        ctl.forward.add(5, 6.7e-3)
    assert price(ctl, LARGE) > before + 5e-4


def test_one_verification_does_not_set_the_price_nor_does_a_shared_forward():
    ctl = flat_gemm_controller()
    verify(ctl, LARGE, 5.7e-3)
    a, b = ctl.forward.line()
    assert ctl.forward_seconds(9, a, b) == a + b * 9  # (ROW_MIN not reached)
    verify(ctl, LARGE, 5.7e-3)
    a, b = ctl.forward.line()
    assert ctl.forward_seconds(9, a, b) < a + b * 9
    ctl.sessions = 4  # a batch: the line's share of the fixed cost, not one session's reading
    assert ctl.forward_seconds(9, a / 4, b) == a / 4 + b * 9


def test_a_one_off_counts_as_at_most_outlier_times_the_line():
    ctl = flat_gemm_controller()
    for s in (5.7e-3, 5.7e-3, 1.0):  # a 1 s forward (a capture, a collection)
        verify(ctl, LARGE, s)
    assert price(ctl, LARGE) < 4 * 6.5e-3
