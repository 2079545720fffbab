"""The adaptive policy with an overlapping draft (controller.py, docs/architecture.md, "Adaptive
speculation"): a tree step may find nothing ready and decode plainly; the ready share prices tree
rungs, an empty answer measures no acceptance, and probes come as often as what they lose allows."""

import pytest
import torch

from specextend.controller import TreeController
from specextend.ladder import PLAIN

from test_controller import FIXED, PROFILES, ROW, RUNGS, simulate


def simulate_overlap(ctl, accepted, steps, ready, seed=0, level=0.0003):
    """`simulate` with an overlapping draft: each tree asked is ready with probability `ready`
    (seeded), else the step decodes plainly after the wait (record_unready). The wait is flat."""
    gen = torch.Generator().manual_seed(seed)
    chosen, got = [], []
    for _ in range(steps):
        r = ctl.choose()
        has = not r.plain and torch.rand((), generator=gen).item() < ready
        rows = r.nodes + 1 if has else 1
        ctl.record_forward(rows, FIXED + ROW * rows)
        if r.plain:
            ctl.record_plain()
        elif has:
            covered = [q for q in ctl.rungs[1:] if q.nodes <= r.nodes and q.depth <= r.depth]
            ctl.record_spec(r, level, {q: accepted[q] for q in covered})
        else:
            ctl.record_unready(r, level)
        chosen.append(r)
        got.append(has)
    return chosen, got


def test_an_unready_step_lowers_the_ready_share_not_the_acceptance():
    ctl = TreeController(list(RUNGS))
    ctl.accepted = {RUNGS[-1]: 4.0}
    ctl.record_unready(RUNGS[-1], 0.001)
    assert ctl.accepted == {RUNGS[-1]: 4.0} and ctl.ready == pytest.approx(0.7) and ctl.unready_steps == 1
    assert ctl.spec_steps == 0 and ctl.plain_steps == 0
    ctl.record_spec(RUNGS[-1], 0.001, {RUNGS[-1]: 4})
    assert ctl.ready == pytest.approx(0.79)


def test_the_ready_share_prices_a_tree_step():
    """A tree that pays when it is always ready does not when it rarely is: an unready ask costs
    the wait plus a plain step and yields one token."""
    accepted = dict(zip(RUNGS[1:], PROFILES["medium"]))
    often, _ = simulate_overlap(TreeController(list(RUNGS)), accepted, 300, ready=0.9)
    rarely, _ = simulate_overlap(TreeController(list(RUNGS)), accepted, 300, ready=0.05, level=0.004)
    assert sum(not r.plain for r in often[-100:]) > 90
    assert sum(not r.plain for r in rarely[-100:]) < 25  # probes only


def test_the_warm_up_asks_again_when_its_tree_was_not_ready():
    """An empty answer measures nothing: the warm-up's tree is asked again (a bounded number of
    times), so that a first unready step does not leave the session plain without a measurement."""
    ctl = TreeController(list(RUNGS))
    first = ctl.choose()
    assert first == RUNGS[1]
    ctl.record_unready(first, 0.001)
    assert ctl.choose() == RUNGS[1]  # again
    ctl.record_unready(first, 0.001)
    ctl.record_unready(first, 0.001)
    ctl.record_unready(first, 0.001)
    assert ctl.choose() == PLAIN  # WARM_TRIES asks in all: on without a measurement


def test_a_probe_that_met_an_unready_tree_asks_once_more():
    accepted = dict(zip(RUNGS[1:], PROFILES["useless"]))
    ctl = TreeController(list(RUNGS))
    simulate(ctl, accepted, 40)  # plain, with probes
    for _ in range(2000):
        r = ctl.choose()
        if ctl._probing:
            break
        assert r.plain
        ctl.record_forward(1, FIXED + ROW)
        ctl.record_plain()
    assert ctl._probing
    probes = ctl.probe_steps
    ctl.record_unready(RUNGS[-1], 0.001)
    assert ctl._probing and ctl.choose() == RUNGS[-1]  # the probe again
    ctl.record_unready(RUNGS[-1], 0.001)
    assert not ctl._probing and ctl.probe_steps == probes + 1  # done: it counts, and backs off


def test_a_probe_that_loses_little_comes_often():
    """Probes lose about a tenth of the time against the best choice: a full tree that an
    overlapping draft has ready (a flat wait) loses less against plain steps than one drafted on
    the target's path (a level's cost each), so its probes come sooner and more often."""
    useless = dict(zip(RUNGS[1:], PROFILES["useless"]))
    ready, _ = simulate_overlap(TreeController(list(RUNGS)), useless, 300, ready=1.0, level=0.0003)
    drafted = simulate(TreeController(list(RUNGS)), useless, 300)
    probes = [[i for i, r in enumerate(c) if r == RUNGS[-1]][1:] for c in (ready, drafted)]
    assert probes[0][0] < probes[1][0] and len(probes[0]) > len(probes[1])
    assert all(r in (PLAIN, RUNGS[-1]) for c in (ready, drafted) for r in c[3:])
