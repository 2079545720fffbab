"""The adaptive policy with an overlapping draft whose trees come in runs (controller.py,
docs/architecture.md, "Adaptive speculation"): after plain steps the draft's pool has followed
their tokens without growing a tree below them, so a run's first tree waits longer and takes less
than the trees after it. The policy measures the run apart from its first step, so that a tree
that pays in a run is not judged by its first step alone."""

import statistics

import pytest
import torch

from specextend.config import TreeConfig
from specextend.controller import AlwaysSpeculate, TreeController
from specextend.costs import RUN_STEPS
from specextend.ladder import PLAIN, ladder

RUNGS = ladder(TreeConfig(16, 6, 4))
PLAIN_S, PLAIN_LOOKUP = 3.05e-3, 0.56  # a plain step with its context-lookup chain (two H100s at 16K, run Q)


def run_steps(ctl, steps=250, seed=0, accepted=3.0, wait=1.0e-3, first_accepted=1.0, first_wait=3.6e-3,
              ready=0.85, first_ready=0.5):
    """`steps` steps of an overlapping draft on two GPUs, shaped on the served runs of 2026-11-28
    (benchmarks/README.md): a tree after a tree waits `wait` and is ready with probability `ready`;
    a run's first tree (after a plain or unready step) waits `first_wait` and is ready with
    `first_ready`, accepting `first_accepted` (seeded). Returns tokens per ms and the kinds, one
    letter a step: t (a tree), u (unready: decoded plainly), p (plain)."""
    gen = torch.Generator().manual_seed(seed)
    after_tree, tokens, seconds, kinds = False, 0.0, 0.0, []
    for _ in range(steps):
        ctl.chain_now = (2, PLAIN_LOOKUP)  # what the plain step's chain would add (RequestLookup.peek)
        r = ctl.choose()
        lucky = torch.rand((), generator=gen).item()
        if r.plain:
            ctl.record_forward(2, 2.55e-3)
            ctl.record_plain(step_s=PLAIN_S, lookup=PLAIN_LOOKUP)
            tokens, seconds, after_tree = tokens + 1 + PLAIN_LOOKUP, seconds + PLAIN_S, False
            kinds.append("p")
            continue
        w = wait if after_tree else first_wait
        if lucky > (ready if after_tree else first_ready):
            ctl.record_forward(1, 2.55e-3)
            ctl.record_unready(r, w, step_s=w + PLAIN_S)
            tokens, seconds, after_tree = tokens + 1, seconds + w + PLAIN_S, False
            kinds.append("u")
            continue
        a = accepted if after_tree else first_accepted
        took = {q: min(a, q.depth) for q in RUNGS[1:] if q.nodes <= r.nodes and q.depth <= r.depth}
        ctl.record_forward(r.nodes + 1, 2.8e-3)
        ctl.record_spec(r, w, took, step_s=w + 3.8e-3)
        tokens, seconds, after_tree = tokens + 1 + took[r], seconds + w + 3.8e-3, True
        kinds.append("t")
    return tokens / seconds / 1e3, "".join(kinds)


def mean_rate(make, seeds=6, **kw):
    return statistics.mean(run_steps(make(), seed=s, **kw)[0] for s in range(seeds))


def test_a_runs_first_tree_is_measured_apart():
    """With overlap the first tree after a plain step feeds the switch's averages, not the draft's
    wait line, the acceptance or the ready share; the tree after it feeds those."""
    ctl = TreeController(list(RUNGS), overlap=True)
    top = RUNGS[-1]
    ctl.record_spec(top, 0.004, {top: 1}, step_s=0.0075)
    assert ctl.switch_tokens == 2.0 and ctl.switch_s == 0.0075
    assert not ctl.draft.known and ctl.accepted == {} and ctl.ready == 1.0 and ctl.in_run and not ctl.steady
    ctl.record_spec(top, 0.001, {top: 3}, step_s=0.005)
    assert ctl.draft(top.depth) == pytest.approx(0.001) and ctl.accepted == {top: 3} and ctl.steady
    assert ctl.switch_tokens == 2.0  # untouched
    ctl.record_unready(top, 0.001, step_s=0.004)  # an unready answer inside a run: the ready share
    assert ctl.ready < 1.0 and not ctl.in_run
    ctl.record_unready(top, 0.004, step_s=0.007)  # ... and the next ask begins a run: the switch's
    assert ctl.switch_s == pytest.approx(0.9 * 0.0075 + 0.1 * 0.007)
    ctl.record_plain(step_s=0.003)
    assert not ctl.asking and not ctl.in_run


def test_without_overlap_nothing_changes():
    ctl = TreeController(list(RUNGS))
    top = RUNGS[-1]
    ctl.record_spec(top, 0.004, {top: 1}, step_s=0.0075)
    assert ctl.switch_s is None and ctl.accepted == {top: 1} and ctl.draft.known
    assert ctl.draft.proportional  # drafting on the step's path costs by depth


def test_with_overlap_the_wait_is_flat_in_the_depth():
    """A ready tree's wait is its answer's way, whatever its depth: a wait measured on a shallow
    tree prices a deep one the same (a line through the origin would double it)."""
    ctl = TreeController(list(RUNGS), overlap=True)
    ctl.in_run = True
    ctl.record_spec(RUNGS[1], 0.002, {RUNGS[1]: 2})
    assert ctl.draft(RUNGS[-1].depth) == pytest.approx(ctl.draft(RUNGS[1].depth)) == pytest.approx(0.002)


def test_the_warm_up_and_a_probe_last_until_a_tree_after_a_tree():
    ctl = TreeController(list(RUNGS), overlap=True)
    first = ctl.choose()
    assert first == RUNGS[1]
    ctl.record_spec(first, 0.004, {first: 1}, step_s=0.0075)
    assert ctl.choose() == PLAIN
    ctl.record_plain(step_s=0.003)
    assert ctl.choose() == RUNGS[-1]  # a run's first tree again (after the plain step) ...
    ctl.record_spec(RUNGS[-1], 0.004, {q: 1 for q in RUNGS[1:]}, step_s=0.0075)
    assert ctl.choose() == RUNGS[-1]  # ... so one more: the run's own costs
    ctl.record_spec(RUNGS[-1], 0.001, {q: 1 for q in RUNGS[1:]}, step_s=0.0045)
    assert ctl.steady and not ctl._probing


def test_trees_that_pay_in_a_run_are_taken_though_its_first_step_does_not():
    """Shaped on the served runs: a run's first tree waits 3.6 ms and takes one token, the rest wait
    1 ms and take three. A policy that judged trees by their first steps (overlap not said) stayed
    on plain steps; with overlap it takes the runs, at about every-step trees' rate."""
    with_overlap = mean_rate(lambda: TreeController(list(RUNGS), overlap=True))
    first_steps_only = mean_rate(lambda: TreeController(list(RUNGS)))
    every_step = mean_rate(lambda: AlwaysSpeculate(list(RUNGS)))
    plain = (1 + PLAIN_LOOKUP) / PLAIN_S / 1e3
    assert every_step > 1.1 * plain  # (the shape: trees pay in runs)
    assert first_steps_only < plain
    assert with_overlap > 1.1 * first_steps_only and with_overlap > 0.95 * every_step
    _, kinds = run_steps(TreeController(list(RUNGS), overlap=True))
    assert kinds.count("p") < 0.1 * len(kinds)


def test_trees_that_do_not_pay_even_in_a_run_are_left():
    """Where a run's trees take little (1.2 tokens), the policy decodes plainly but for its warm-up
    and probes, each two tree steps long: within a few percent of plain steps' rate."""
    plain = (1 + PLAIN_LOOKUP) / PLAIN_S / 1e3
    _, kinds = run_steps(TreeController(list(RUNGS), overlap=True), accepted=1.2)
    assert kinds[-150:].count("p") > 0.8 * 150
    assert mean_rate(lambda: TreeController(list(RUNGS), overlap=True), accepted=1.2) > 0.92 * plain


def test_a_tree_after_plain_steps_pays_for_beginning_a_run():
    """From a plain step a tree is valued with one more first step spread over RUN_STEPS steps; once
    trees are asked, without it (and with a small margin to stay: leaving costs a switch later)."""
    ctl = TreeController(list(RUNGS), overlap=True)
    top = RUNGS[-1]
    ctl.record_spec(top, 0.004, {top: 1}, step_s=0.0075)
    ctl.record_spec(top, 0.001, {top: 3}, step_s=0.005)
    asked = ctl.value(top)
    ctl.record_plain(step_s=0.003)
    fresh = ctl.value(top)
    assert fresh < asked
    steady_tokens, steady_s = ctl.rate(top) * ctl.step_seconds(top), ctl.step_seconds(top)
    n = RUN_STEPS - 1
    assert fresh == pytest.approx((2.0 + n * steady_tokens) / (0.0075 + n * steady_s))


def test_a_draft_whose_runs_never_begin_is_left():
    """With overlap every ask after a plain or an unready step is a run's first: where none of them
    finds a tree ready (the served 8B geometry's random pair on two H200s, 2026-11-28: 252 of 256
    steps asked, none ready, 0.83x `ar`), the share of runs that begin prices the switch, and the
    policy decodes plainly but for probes; a tree that came once and then never again does not
    keep it asking."""
    plain = (1 + PLAIN_LOOKUP) / PLAIN_S / 1e3
    top = RUNGS[-1]
    for accepted in (1, 2, 3):
        ctl = TreeController(list(RUNGS), overlap=True)
        took = {q: min(accepted, q.depth) for q in RUNGS[1:]}
        for wait, step_s in ((3.6e-3, 7.4e-3), (1.0e-3, 4.8e-3)):  # a run that began, then ...
            ctl.record_forward(top.nodes + 1, 2.8e-3)
            ctl.record_spec(top, wait, took, step_s=step_s)
        rate, kinds = run_steps(ctl, ready=0.0, first_ready=0.0, first_wait=1.0e-3)  # ... no tree ever again
        assert kinds[-150:].count("u") < 0.1 * 150, (accepted, kinds)
        assert rate > 0.9 * plain
        assert ctl.switch_misses > 0
