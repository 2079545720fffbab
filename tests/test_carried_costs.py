"""A session starts from the costs the engine's last finished session measured (controller.Costs,
docs/architecture.md, "Adaptive speculation"): no smallest tree and plain step to measure them,
the full tree first to measure this text's acceptance, then the choice a warmed-up controller
makes."""

import pytest

from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.controller import TreeController
from specextend.ladder import PLAIN, ladder
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine

from helpers import slow_target, warm_until_costs
from test_controller import PROFILES, RUNGS, simulate

TREE = TreeConfig(16, 6, 4)


def warmed(profile="easy", steps=20):
    ctl = TreeController(list(RUNGS))
    simulate(ctl, dict(zip(RUNGS[1:], PROFILES[profile])), steps)
    return ctl


def test_a_prior_needs_the_costs_the_warm_up_measures():
    ctl = TreeController(list(RUNGS))
    assert ctl.costs() is None
    simulate(ctl, dict(zip(RUNGS[1:], PROFILES["easy"])), 1)  # the smallest tree: no plain step yet
    assert ctl.costs() is None
    assert warmed().costs() is not None


@pytest.mark.parametrize("profile", ["easy", "wide", "medium", "hard", "useless"])
def test_a_primed_controller_measures_acceptance_first_then_chooses_as_a_warmed_one(profile):
    """Costs from an earlier session on an easy text; this text's acceptance from its own first
    (full) tree: then the warmed controller's choice, in fewer warm-up steps than a cold start."""
    accepted = dict(zip(RUNGS[1:], PROFILES[profile]))
    new = TreeController(list(RUNGS))
    new.start_from(warmed("easy").costs())
    chosen = simulate(new, accepted, 12)
    assert chosen[0] == RUNGS[-1]  # no smallest tree, no plain step
    ref = warmed(profile, 12)
    assert new.best() == ref.best() and chosen[1:].count(ref.best()) >= len(chosen) // 2
    assert TreeController(list(RUNGS)).choose() == RUNGS[1]  # cold: the smallest tree first


def test_a_prior_is_a_copy():
    old = warmed("easy")
    line = old.forward.line()
    new = TreeController(list(RUNGS))
    new.start_from(old.costs())
    simulate(new, dict(zip(RUNGS[1:], PROFILES["hard"])), 5, level=0.01)
    assert old.forward.line() == line and not new.accepted.keys() - set(RUNGS)


def test_a_bounded_request_takes_the_prior_too():
    small = TreeController(ladder(TreeConfig(8, 4, 4)))
    small.start_from(warmed("easy").costs())
    assert small.choose() == small.top


def test_an_engines_later_sessions_start_from_the_earlier_ones(tiny_models, monkeypatch):
    target, draft = tiny_models("float64")
    prompt = [(7 * i + 3) % 200 for i in range(40)]
    params = SamplingParams(40, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt, params)
    worker = DraftWorker(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive"), target, worker)
    made = []
    original = Engine.new_controller

    def spy(self, tree):
        made.append(original(self, tree))
        return made[-1]

    monkeypatch.setattr(Engine, "new_controller", spy)
    had = []
    for _ in range(3):
        had.append(engine._costs is not None)
        assert engine.generate(prompt, params)[0] == ref
    assert not had[0] and any(had) and [c.primed for c in made] == had
    kept = engine._costs
    assert engine.generate(prompt, params, speculate=False)[0] == ref
    assert engine._costs is kept  # a plain request measures no draft: it leaves the prior
    engine.carry_costs = False
    engine.generate(prompt, params)
    assert not made[-1].primed and engine._costs is kept
    worker.shutdown()


def test_the_prefills_forwards_are_not_the_first_steps():
    """A session whose first step is plain (a prior saying trees cannot pay, or a slow draft) prices
    a plain forward from that step's forward alone: the prefill's forwards go into the line only
    (they once inflated it sixfold on a CPU, and the session then speculated where plain paid)."""
    ctl = TreeController(list(RUNGS))
    ctl.seed_draft(10.0)  # the draft's prefill took 10x the target's: start plain
    ctl.record_forward(512, 0.030)  # the prefill
    assert ctl.choose() == PLAIN
    ctl.record_forward(1, 0.002)
    ctl.record_plain(step_s=0.0021)
    assert ctl.plain_forward == pytest.approx(0.002) and ctl.extra_plain == pytest.approx(0.0001)


def test_carried_costs_that_say_no_tree_pays_start_plain_and_probe_the_smallest_tree_rarely():
    """Costs from a session whose draft cost as much as several target forwards: the next session
    starts plain (no warm-up tree: one would cost several plain steps and could win nothing), and
    the way back, should the draft have grown faster, is the smallest tree as a probe, `max_probe`
    steps apart (no rung could beat a plain step even fully accepted: costs.probe_interval), the
    schedule going on from where the last session left it."""
    from test_controller import FIXED

    slow = TreeController(list(RUNGS))
    simulate(slow, dict(zip(RUNGS[1:], PROFILES["easy"])), 12, level=50 * FIXED)
    new = TreeController(list(RUNGS), max_probe=40)
    new.start_from(slow.costs())
    chosen = simulate(new, dict(zip(RUNGS[1:], PROFILES["easy"])), 130, level=50 * FIXED)
    trees = [i for i, r in enumerate(chosen) if not r.plain]
    assert new.primed and all(chosen[i] == RUNGS[1] for i in trees)
    assert trees[0] <= 40 and {b - a for a, b in zip(trees, trees[1:])} == {41}  # (the schedule carried on)


def test_the_probe_schedule_goes_on_across_short_sessions():
    """Sessions shorter than the probe interval still probe now and then: each starts where the
    last left the schedule (Costs.since_probe), so a draft too slow to pay is tried again every
    `max_probe` steps of the engine's traffic, not never (each session would carry the same costs)."""
    from test_controller import FIXED

    prev = TreeController(list(RUNGS))
    simulate(prev, dict(zip(RUNGS[1:], PROFILES["easy"])), 12, level=50 * FIXED)
    trees = 0
    for _ in range(8):  # 8 sessions of 25 steps, max_probe 40: 200 steps
        new = TreeController(list(RUNGS), max_probe=40)
        new.start_from(prev.costs())
        trees += sum(not r.plain for r in simulate(new, dict(zip(RUNGS[1:], PROFILES["easy"])), 25, level=50 * FIXED))
        prev = new
    assert 4 <= trees <= 5  # one every 41 steps


def test_an_engines_first_tree_does_not_price_the_draft(tiny_models):
    """The first tree an engine verifies after start-up waits for one-off costs (on the served 8B
    geometry, two H200s, 2026-11-28: 34 ms against 3): that wait stays out of the draft's cost line,
    which the carried costs hand to every later session (it had priced every tree out)."""
    target, draft = tiny_models("float64")
    prompt, params = [(7 * i + 3) % 200 for i in range(40)], SamplingParams(40, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt, params)

    class SlowFirstStep(DraftWorker):
        calls = 0

        def step(self, *a, **kw):
            SlowFirstStep.calls += 1
            if SlowFirstStep.calls == 1:
                import time

                time.sleep(0.5)
            return super().step(*a, **kw)

    worker = SlowFirstStep(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive"), slow_target(target), worker)
    warm_until_costs(engine, prompt, params, ref)  # (a later session's costs hold no first wait either)
    assert SlowFirstStep.calls >= 2 and engine._costs is not None
    assert engine._costs.draft(TREE.depth) < 0.25  # (with the first wait: at least 0.5 s x 0.1 weight ... x depth)
    worker.shutdown()


def test_a_primed_sessions_probe_is_not_followed_by_the_full_tree():
    """Carried costs say the full tree could win too little to warm up on (under WARM_MARGIN):
    the session starts plain and its probes find out. A probe that measured little is followed by
    the best rung, not by the full tree as a cold session's second warm-up step (which cost a tiny
    pair's second request on a CPU 8.8 ms, ~7% of it, 2026-11-29)."""
    level = 0.008  # a draft level (s): the full tree fully accepted beats a plain step, not by WARM_MARGIN
    prev = TreeController(list(RUNGS))
    simulate(prev, dict(zip(RUNGS[1:], PROFILES["hard"])), 30, level=level)
    new = TreeController(list(RUNGS), max_probe=40)
    new.start_from(prev.costs())
    assert not new._top_may_pay(1.25) and new._top_may_pay()
    chosen = simulate(new, dict(zip(RUNGS[1:], PROFILES["hard"])), 120, level=level)
    trees = [i for i, r in enumerate(chosen) if not r.plain]
    assert chosen[0] == PLAIN and trees  # (it probes)
    assert all(b - a > 1 for a, b in zip(trees, trees[1:]))  # each probe alone


def test_a_sessions_first_tree_does_not_price_the_draft(tiny_models):
    """A session's first tree waits for the draft's first step on that prompt (its selection, its
    first catch-up: 36-49 ms on the 8B geometry at 16K, one H200, 2026-11-30, against ~2.5 for the
    next), which the catch-up line took as a switch's price: the policy then never came back to
    trees. That wait stays out of the costs the engine carries."""
    target, draft = tiny_models("float64")
    prompt, params = [(7 * i + 3) % 200 for i in range(40)], SamplingParams(40, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt, params)

    class SlowFirstStepOfTheSecond(DraftWorker):
        calls, sessions = 0, []

        def step(self, session_id, *a, **kw):
            if session_id not in self.sessions:
                self.sessions.append(session_id)
                if len(self.sessions) == 2:
                    import time

                    time.sleep(0.5)
            return super().step(session_id, *a, **kw)

    worker = SlowFirstStepOfTheSecond(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive"), slow_target(target), worker)
    engine.defer_opens = False  # (the second session's draft opens at once)
    assert engine.generate(prompt, params)[0] == ref
    first = engine._costs
    assert first is not None and first.draft(TREE.depth) < 0.25
    assert engine.generate(prompt, params)[0] == ref
    assert len(worker.sessions) == 2
    costs = engine._costs  # (the 0.5 s wait, in the draft's line or the catch-up's, would price a tree out)
    assert costs.draft(TREE.depth) < 0.25 and (costs.catchup is None or costs.catchup(8) < 0.25)
    worker.shutdown()


def test_the_prices_a_session_ends_with_are_reported():
    """Carrying.priced (the rows of the benchmarks): the policy's own prices, in ms, so that a choice
    can be read against them; an engine's request carries them in its stats."""
    ctl = warmed("easy")
    p = ctl.priced()
    assert p["plain_forward"] == pytest.approx(1e3 * ctl.plain_forward)
    assert p["forward"] == pytest.approx([1e3 * v for v in ctl.forward.line()])
    assert p["plain_step"] == pytest.approx(1e3 * ctl.step_seconds(PLAIN)) and p["plain_step"] > 0
    assert p["top_step"] > p["plain_step"] and p["primed"] is False
    assert p["rows"] == {str(r): pytest.approx(1e3 * v) for r, (v, _) in ctl.rows_price.items()} and p["rows"]


def test_an_engines_request_reports_its_prices(tiny_models):
    target, draft = tiny_models("float64")
    worker = DraftWorker(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive"), target, worker)
    _, _, stats = engine.generate(list(range(3, 43)), SamplingParams(12, ignore_eos=True))
    assert stats.priced["plain_step"] is not None and stats.priced["plain_step"] > 0
    assert stats.priced["draft"][0] >= 0 and set(stats.priced) >= {"forward", "chains", "probe_every"}
    worker.shutdown()
    _, _, plain = Engine(EngineConfig(mode="ar"), target).generate(list(range(3, 43)), SamplingParams(4))
    assert plain.priced == {}


def test_a_reading_the_chain_line_cannot_split_leaves_the_plain_price():
    """A step whose forward took less than the chain line's slope says its rows beyond the first
    cost (a slope a one-off set: a shape's first forward) prices no plain step: before, its share
    was clamped to zero, the plain step priced at nothing, and the policy predicted 1e9 tokens/s
    for plain steps and took no tree (the real pair in e2e on an H200, 2026-11-30)."""
    ctl = TreeController(list(RUNGS))
    for rows, seconds in [(1, 0.002), (1, 0.002), (9, 1.0), (1, 0.002)]:  # (9 rows: the shape's first forward)
        ctl.begin_step()
        ctl.record_forward(rows, seconds)
        ctl.record_plain(step_s=seconds)
    before = ctl.plain_forward
    assert before > 0.001 and ctl.chains.line()[1] * 8 > 0.0021
    ctl.begin_step()
    ctl.record_forward(9, 0.0021)  # a lookup run's step: 9 rows
    ctl.record_plain(step_s=0.0021, lookup=1)
    assert ctl.plain_forward == before and ctl.step_seconds(PLAIN) > 0.001


def test_the_e2e_suites_measured_request_starts_unprimed(tiny_models):
    """The e2e suite's warm-up request meets every shape cold; its costs are not the first measured
    request's prior (a served app's first request after its warm-up has none either)."""
    from specextend.bench import e2e

    target, draft = tiny_models("float64")
    worker = DraftWorker(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive"), target, worker)
    warm_until_costs(engine, list(range(3, 83)), SamplingParams(24, ignore_eos=True))
    assert engine._costs is not None  # (what the warm-up request would leave)
    e2e.warm_up(engine, list(range(3, 83)), set())
    assert engine._costs is None
    worker.shutdown()


def test_a_primed_sessions_full_tree_starts_the_probe_schedule_again():
    """A primed session's first step is the full tree (it measures this text's acceptance for every
    rung, as a probe of the top does), so the probe schedule carried from the last session starts
    again from it: no second full tree a few steps later (the 8B geometry replayed at 2-3 on an
    H200 took one to three more a 43-step request, 2026-12-01)."""
    from dataclasses import replace

    wide = dict(zip(RUNGS[1:], PROFILES["wide"]))
    prev = warmed("wide")
    assert prev.best() != RUNGS[-1]  # (a rung below the top: probes are due now and then)
    costs = replace(prev.costs(), probe_every=10, since_probe=9)  # a probe due at the next step
    new = TreeController(list(RUNGS))
    new.start_from(costs)
    chosen = simulate(new, wide, 10)
    assert chosen[0] == RUNGS[-1] and new.since_probe == 9
    assert RUNGS[-1] not in chosen[1:] and new.probe_steps == 0
