"""The adaptive policy (controller.py, docs/architecture.md, "Adaptive speculation"): the tree of
each step chosen among a ladder of sizes, plain decoding included, to maximise predicted tokens
per second; backing off as more sessions share the target's forwards; probing so it can come
back (on simulated costs; the policy in the engine, lossless whatever it chooses, is
test_controller_engine.py's)."""

import math

import pytest

from specextend.config import TreeConfig
from specextend.controller import TreeController
from specextend.ladder import PLAIN, Rung, ladder, prefix_accepts
from specextend.recheck import PLAIN_DOUBT


TREE = TreeConfig(16, 6, 4)
RUNGS = ladder(TREE)  # plain, 4 nodes (3 and 4 levels), 8 and 16 (3 and 6 levels)


def test_ladder():
    """Sizes doubling from 4, each as deep as the session's tree (n nodes reach n levels at most),
    the session's tree at its depth, and each size that goes deeper than 3 levels also 3 levels
    deep (half the drafting)."""
    assert RUNGS == [PLAIN, Rung(4, 3), Rung(4, 4), Rung(8, 3), Rung(8, 6), Rung(16, 3), Rung(16, 6)]
    assert ladder(TreeConfig(12, 3, 2)) == [PLAIN, Rung(4, 3), Rung(8, 3), Rung(12, 3)]
    assert ladder(TreeConfig(2, 4, 2)) == [PLAIN, Rung(2, 4)]  # the session's tree as configured
    assert ladder(TreeConfig(32, 6, 4))[-4:] == [Rung(16, 3), Rung(16, 6), Rung(32, 3), Rung(32, 6)]
    assert ladder(TreeConfig(16, 4, 4))[1:5] == [Rung(4, 3), Rung(4, 4), Rung(8, 3), Rung(8, 4)]


def test_a_rung_never_measured_is_estimated_from_one_inside_it():
    """The fallback estimate is a rung with no more nodes and no more depth (a lower bound): the
    16-node 3-level rung takes the 8-node 3-level one's, not the 8-node 6-level one's."""
    ctl = TreeController(list(RUNGS))
    ctl.accepted = {Rung(8, 3): 1.5, Rung(8, 6): 2.5}
    assert ctl.expected_accepted(Rung(16, 3)) == 1.5 and ctl.expected_accepted(Rung(16, 6)) == 2.5


def test_prefix_accepts_counts_what_each_smaller_tree_would_have_accepted():
    parents = [-1, -1, 0, 2, 0, 1, 3]  # best first; depths 1 1 2 3 2 2 4
    rungs = [PLAIN, Rung(2, 1), Rung(3, 2), Rung(5, 3), Rung(7, 4)]
    got = prefix_accepts([0, 2, 3, 6], parents, Rung(7, 4), rungs)
    # Rung(2, 1): nodes {0, 1} -> 1; Rung(3, 2): {0, 1, 2} -> 2; Rung(5, 3): {0..4} -> 3; all -> 4
    assert got == {Rung(2, 1): 1, Rung(3, 2): 2, Rung(5, 3): 3, Rung(7, 4): 4}
    # a smaller verified tree measures only the rungs it covers
    assert prefix_accepts([1], parents[:3], Rung(3, 2), rungs) == {Rung(2, 1): 1, Rung(3, 2): 1}
    # a depth bound leaves out deeper nodes even among the best ones
    assert prefix_accepts([0, 2, 3], parents, Rung(7, 4), [Rung(4, 2)]) == {Rung(4, 2): 2}


# synthetic costs: a forward of r rows costs FIXED + ROW * r (B sessions share one forward, each
# with the same tree), the draft LEVEL per level
FIXED, ROW, LEVEL = 0.010, 0.0004, 0.0008


def true_rate(rung, accepted, sessions=1):
    own = FIXED / sessions + ROW * (rung.nodes + 1) + (0 if rung.plain else LEVEL * rung.depth)
    return (1 + (0 if rung.plain else accepted[rung])) / own


def simulate(ctl, accepted, steps, sessions=1, level=LEVEL):
    """Drives a controller with the synthetic costs (a draft level costing `level`) and `accepted`
    draft tokens per rung."""
    chosen = []
    for _ in range(steps):
        r = ctl.choose(sessions)
        rows = sessions * (r.nodes + 1)
        ctl.record_forward(rows, FIXED + ROW * rows)
        if r.plain:
            ctl.record_plain()
        else:
            covered = [q for q in ctl.rungs[1:] if q.nodes <= r.nodes and q.depth <= r.depth]
            ctl.record_spec(r, level * r.depth, {q: accepted[q] for q in covered})
        chosen.append(r)
    return chosen


PROFILES = {  # accepted draft tokens per step of the trees (nodes x levels) 4x3, 4x4, 8x3, 8x6, 16x3, 16x6
    "easy": (2.2, 2.6, 2.9, 3.6, 3.0, 4.8),  # deep paths: the full tree
    "wide": (1.6, 1.65, 2.0, 2.05, 2.7, 2.8),  # many short candidates: 16 nodes, 3 levels
    "deep8": (1.6, 1.9, 2.0, 2.6, 2.1, 2.7),
    "deep4": (1.6, 2.2, 1.9, 2.3, 2.0, 2.4),  # one sure path: a narrow deep tree
    "medium": (1.6, 1.65, 2.2, 2.2, 2.3, 2.4),
    "hard": (0.8, 0.85, 0.9, 1.0, 1.0, 1.1),
    "useless": (0.05, 0.05, 0.05, 0.05, 0.06, 0.06),
}


def test_a_draft_far_slower_than_the_target_is_not_warmed_up_on_its_full_tree():
    """After the smallest tree shows what a level of drafting costs, the full tree is skipped when
    even every level accepted could not beat a plain step (a 68M draft beside a tiny target)."""
    chosen = simulate(TreeController(list(RUNGS)), dict.fromkeys(RUNGS[1:], 0.0), 12, level=50 * FIXED)
    assert chosen[0] == RUNGS[1] and RUNGS[-1] not in chosen[1:]
    assert all(r.plain for r in chosen[1:])


def test_host_work_of_a_step_counts_against_speculation():
    """Speculative steps that cost more wall time than their forwards and draft wait (host work:
    verification, retrieval) are charged for it: with the step's wall time given, a tree that
    looks worth it by forwards and draft alone is dropped for plain steps; without it, kept."""
    accepted = dict(zip(RUNGS[1:], PROFILES["medium"]))
    host = 0.03  # seconds of host work in every speculative step, none in plain ones

    def run(give_wall):
        ctl, chosen = TreeController(list(RUNGS)), []
        for _ in range(60):
            r = ctl.choose()
            fwd = FIXED + ROW * (r.nodes + 1)
            ctl.record_forward(r.nodes + 1, fwd)
            if r.plain:
                ctl.record_plain(step_s=fwd if give_wall else None)
            else:
                covered = [q for q in ctl.rungs[1:] if q.nodes <= r.nodes and q.depth <= r.depth]
                draft = LEVEL * r.depth
                ctl.record_spec(r, draft, {q: accepted[q] for q in covered},
                                step_s=fwd + draft + host if give_wall else None)
            chosen.append(r)
        return chosen[10:]

    assert all(not r.plain for r in run(give_wall=False)[-20:])  # by forwards and draft: a tree pays
    steady = run(give_wall=True)
    assert sum(r.plain for r in steady) >= 0.8 * len(steady)  # host work included: plain steps pay


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_picks_the_size_of_most_tokens_per_second(profile):
    accepted = dict(zip(RUNGS[1:], PROFILES[profile]))
    want = max(RUNGS, key=lambda r: true_rate(r, accepted))
    ctl = TreeController(list(RUNGS))
    chosen = simulate(ctl, accepted, 80)
    assert chosen[:3] == [RUNGS[1], PLAIN, RUNGS[-1]]  # warm-up: the smallest tree, a plain step, the full tree
    steady = chosen[3:]
    assert steady.count(want) >= 0.8 * len(steady)  # the rest are probes of the full tree and, where
    assert set(steady) <= {want, RUNGS[-1], PLAIN}  # a tree is best, rechecks of the plain step (recheck.py)
    if want != PLAIN:
        assert steady.count(PLAIN) == ctl.recheck.done
    assert ctl.probe_steps == (0 if want == RUNGS[-1] else steady.count(RUNGS[-1]))


def test_the_profiles_cover_the_ladder():
    """The test above is only worth something if each profile wants a different rung."""
    wants = {max(RUNGS, key=lambda r: true_rate(r, dict(zip(RUNGS[1:], p)))) for p in PROFILES.values()}
    assert wants == set(RUNGS)


def test_backs_off_smoothly_as_the_batch_grows():
    accepted = dict(zip(RUNGS[1:], PROFILES["easy"]))
    picks = []
    for sessions in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64):
        ctl = TreeController(list(RUNGS))
        chosen = simulate(ctl, accepted, 40, sessions)
        best = ctl.best()
        assert best == max(RUNGS, key=lambda r: true_rate(r, accepted, sessions))
        assert chosen[-1] in (best, RUNGS[-1])
        picks.append(best.nodes)
    assert picks == sorted(picks, reverse=True)  # never larger with more sessions
    assert picks[0] == 16 and picks[-1] == 0  # the full tree alone, plain steps under heavy load
    assert len(set(picks)) == 4  # through every size in between: no cliff


def test_probes_back_off_exponentially_and_come_back():
    hard = dict(zip(RUNGS[1:], PROFILES["useless"]))
    ctl = TreeController(list(RUNGS))
    chosen = simulate(ctl, hard, 400)
    assert ctl.best() == PLAIN
    warm, *probes = [i for i, r in enumerate(chosen) if r == RUNGS[-1]]  # the warm-up's full tree, the probes
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    top, plain = FIXED + ROW * 17 + LEVEL * 6, FIXED + ROW  # seconds of a full-tree and a plain step
    lost = top * (1 - (1.06 / top) / (1 / plain))  # the probe's time less its tokens' at the plain rate
    base = round(10 * lost / plain)
    assert probes[0] == warm + base + 1  # `base` steps after the warm-up's full tree (which measured the top)
    assert gaps[:3] == [2 * base + 1, 4 * base + 1, 8 * base + 1]
    assert ctl.probe_steps == len(probes) and ctl.plain_steps == chosen.count(PLAIN)
    easy = dict(zip(RUNGS[1:], PROFILES["easy"]))  # the text got easy
    chosen = simulate(ctl, easy, 16 * base + 200)
    assert chosen[-40:] == [RUNGS[-1]] * 40  # a probe found it, and it stayed on the full tree


def test_a_plain_forward_once_timed_slow_is_rechecked_and_plain_steps_come_back():
    """The way back to plain steps (recheck.py): the warm-up's one plain step timed at three times
    its cost makes trees look best where plain steps are; rechecks (plain steps timed alone, spaced
    by what they lose, doubling while a tree stays best) correct the price and the session decodes
    plainly. Without them every step after the warm-up was a tree (the trap seen on a noisy CPU)."""
    accepted = dict.fromkeys(RUNGS[1:], 0.3)  # (plain steps best by ~7%)
    assert max(RUNGS, key=lambda r: true_rate(r, accepted)) == PLAIN
    ctl, chosen, slow = TreeController(list(RUNGS)), [], True
    for _ in range(120):
        r = ctl.choose()
        fwd = FIXED + ROW * (r.nodes + 1)
        if r.plain:
            ctl.record_forward(1, fwd * (3 if slow else 1))
            ctl.record_plain()
            slow = False
        else:
            ctl.record_forward(r.nodes + 1, fwd)
            covered = [q for q in ctl.rungs[1:] if q.nodes <= r.nodes and q.depth <= r.depth]
            ctl.record_spec(r, LEVEL * r.depth, {q: accepted[q] for q in covered})
        chosen.append(r)
    assert not chosen[3].plain  # the slow reading made a tree the best ...
    assert ctl.recheck.done >= 1 and ctl.best() == PLAIN  # ... until a recheck timed a plain step again
    assert chosen[-60:].count(PLAIN) >= 55  # (the rest: probes, spaced by what they could win)


def test_rechecks_back_off_where_trees_pay():
    """Where a tree really is best a recheck loses a step's worth now and then: its interval doubles
    after each (as far as max_probe), and the schedule goes on in the next session (carried costs).
    ("hard": the best tree 1.3x a plain step's rate, within PLAIN_DOUBT: a slow reading could be it.)"""
    accepted = dict(zip(RUNGS[1:], PROFILES["hard"]))
    ctl = TreeController(list(RUNGS))
    chosen = simulate(ctl, accepted, 300)
    plain = [i for i, r in enumerate(chosen) if r.plain][1:]  # after the warm-up's
    gaps = [b - a for a, b in zip(plain, plain[1:])]
    assert len(plain) == ctl.recheck.done >= 3 and all(g2 >= 2 * g1 - 1 for g1, g2 in zip(gaps, gaps[1:]))
    nxt = TreeController(list(RUNGS))
    nxt.start_from(ctl.costs())
    assert (nxt.recheck.since, nxt.recheck.every) == (ctl.recheck.since, ctl.recheck.every)


def test_no_recheck_where_a_tree_outruns_plain_steps_by_far():
    """A tree predicted at PLAIN_DOUBT times a plain step's rate or more takes no recheck where the
    plain forward's reading is within the verification line: it would have to be that far off
    ("easy": the full tree at 2.8x); the steps go on counting, so that a recheck comes at once when
    the tree falls within reach. (A reading above the line is rechecked whatever the rates: the
    test above, a 3x slow reading.)"""
    ctl = TreeController(list(RUNGS))
    chosen = simulate(ctl, dict(zip(RUNGS[1:], PROFILES["easy"])), 300)
    assert ctl.value(ctl.best()) >= PLAIN_DOUBT * ctl.value(PLAIN)
    assert ctl.recheck.done == 0 and chosen.count(PLAIN) == 1  # (the warm-up's)
    chosen = simulate(ctl, dict(zip(RUNGS[1:], PROFILES["hard"])), 20)  # the text got hard: 1.3x
    assert ctl.recheck.done >= 1 and chosen.index(PLAIN) < 5  # within reach: rechecked at once


def test_a_plain_step_beside_a_draft_open_prices_nothing():
    """A plain step whose forward shared the device with the draft's open (`contended`) leaves the
    plain price and the cost lines as they were; it still counts as a plain step."""
    ctl = TreeController(list(RUNGS))
    ctl.record_forward(1, 0.001)
    ctl.record_plain(step_s=0.0012)
    before = (ctl.plain_forward, ctl.forward.line(), ctl.chains.line(), ctl.extra_plain)
    ctl.record_forward(1, 0.003)  # (three times as slow: a prefill beside it)
    ctl.record_plain(contended=True)
    assert (ctl.plain_forward, ctl.forward.line(), ctl.chains.line(), ctl.extra_plain) == before
    assert ctl.plain_steps == 2 and ctl.last_forward_s == 0.003
    ctl.record_forward(1, 0.003)
    ctl.record_plain()
    assert ctl.plain_forward > before[0]  # (uncontended: priced)


def test_a_run_s_plain_steps_count_as_the_same_plain_steps_one_by_one():
    """record_plain_run(n) (a run ahead's tokens, one call) leaves the controller as n
    record_plain() calls do (its twin), and with a reading prices the plain step as one
    record_forward + record_plain with that reading."""
    def fresh():
        ctl = TreeController(list(RUNGS))
        ctl.record_forward(1, 0.001)
        ctl.record_plain(step_s=0.0012, lookup=3)  # (a chain's tokens in the average, to decay)
        ctl.recheck.since = 7
        return ctl

    one, twin = fresh(), fresh()
    one.record_plain_run(5)
    for _ in range(5):
        twin.record_plain()
    fields = ("plain_steps", "since_probe", "plain_forward", "extra_plain", "in_run", "asking")
    assert [getattr(one, f) for f in fields] == [getattr(twin, f) for f in fields]
    assert one.lookup_plain == pytest.approx(twin.lookup_plain) and one.recheck == twin.recheck
    priced, twin = fresh(), fresh()
    priced.record_plain_run(3, 0.0005)
    twin.record_forward(1, 0.0005)
    twin.record_plain(step_s=0.0005)
    twin.record_plain()
    twin.record_plain()
    assert (priced.plain_forward, priced.extra_plain, priced.forward.line(), priced.plain_steps) == \
        (twin.plain_forward, twin.extra_plain, twin.forward.line(), twin.plain_steps)


def test_no_probe_interval_exceeds_max_probe():
    """The interval from measured costs is capped too, not only its doublings: a probe that loses
    much against a cheap plain step still comes within `max_probe` steps."""
    hard = dict(zip(RUNGS[1:], PROFILES["useless"]))
    base = simulate(TreeController(list(RUNGS)), hard, 400)
    ctl = TreeController(list(RUNGS), max_probe=5)
    chosen = simulate(ctl, hard, 400)
    warm, *uncapped = [i for i, r in enumerate(base) if r == RUNGS[-1]]  # the warm-up's full tree, the probes
    probes = [i for i, r in enumerate(chosen) if r == RUNGS[-1]][1:]
    assert uncapped[0] - warm > 6 and probes[0] - warm == 6  # the first interval (from the warm-up's), capped
    assert {b - a for a, b in zip(probes, probes[1:])} == {6}  # then 5 steps and the probe, again


def test_a_draft_whose_prefill_says_it_cannot_pay_is_not_tried_until_a_late_cheap_probe():
    """seed_draft: a draft prefill 12x the target's (the 68M draft beside the tiny target on a CPU)
    starts the session plain; the first probe is the smallest tree, after enough steps that it
    costs a tenth of the time at the prior's price. Here the prior was wrong (the synthetic draft
    is fast): the probe measures it and speculation takes over. A ratio under SLOW_DRAFT changes
    nothing (the smallest tree first)."""
    ctl = TreeController(list(RUNGS))
    ctl.seed_draft(12.0)
    chosen = simulate(ctl, dict(zip(RUNGS[1:], PROFILES["easy"])), 600)
    first = next(i for i, r in enumerate(chosen) if not r.plain)
    assert first > 200 and chosen[first] == RUNGS[1]  # late, and cheap
    assert sum(not r.plain for r in chosen[first:]) > 0.8 * len(chosen[first:])  # the prior corrected
    fast = TreeController(list(RUNGS))
    fast.seed_draft(0.8)
    assert fast.choose() == RUNGS[1] and fast.draft_ratio is None


def test_a_draft_measured_too_slow_for_any_tree_is_probed_only_every_max_probe_steps():
    """A draft slower than its prior said (3.5 plain forwards a level; it costs 12): after the
    smallest-tree probe has measured it, no rung could beat a plain step even with every level
    accepted, so a probe could win nothing: the next probes are the smallest tree again (the way
    back, were the draft to get faster), `max_probe` steps apart, not the full tree at a tenth of
    the time (which lost 10% of a request to trees that could never pay)."""
    ctl = TreeController(list(RUNGS))
    ctl.seed_draft(3.5)
    level = 12 * (FIXED + ROW)  # a draft level costs 12 plain forwards
    chosen = simulate(ctl, dict.fromkeys(RUNGS[1:], 0.0), 4000, level=level)
    probes = [(i, r) for i, r in enumerate(chosen) if not r.plain]
    assert all(r == RUNGS[1] for _, r in probes) and len(probes) == 4
    assert {b[0] - a[0] for a, b in zip(probes, probes[1:])} == {ctl.max_probe + 1}
    spent = sum(FIXED + ROW * (r.nodes + 1) + (level * r.depth if not r.plain else 0) for r in chosen)
    tree_cost = FIXED + ROW * (RUNGS[1].nodes + 1) + level * RUNGS[1].depth
    assert len(probes) * tree_cost < 0.05 * spent  # the 0.95x goal


def test_probes_are_spaced_by_what_they_could_win():
    """costs.probe_interval: a probe that could win only a little (its rung, fully accepted, 5%
    above the best) comes at least lost / (5% of a best step) steps apart, beyond the
    probes-cost-a-tenth rule; one that could win nothing, never (the caller caps it at max_probe)."""
    from specextend.costs import probe_interval

    t_probe, t_best = 10e-3, 1e-3  # a probe ten plain steps long, predicted to yield as much as one
    tenth = probe_interval(t_probe, t_best, 100.0, 1000.0, 4, 10.0)
    assert tenth == 90  # 10 x the 9 ms it loses over a 1 ms step
    assert probe_interval(t_probe, t_best, 100.0, 1000.0, 4, 10.0, gain=0.05) == 180  # 9 ms / 0.05 ms
    assert probe_interval(t_probe, t_best, 100.0, 1000.0, 4, 10.0, gain=2.0) == tenth  # a big win: the tenth rule
    assert probe_interval(t_probe, t_best, 100.0, 1000.0, 4, 10.0, gain=0.0) > 10 ** 9


def test_a_tree_after_steps_without_one_is_priced_with_the_drafts_catch_up():
    """The first tree after plain steps waits for the draft to forward their tokens before its
    levels: a caught-up step's wait beyond the levels' line teaches the catch-up's line (tokens
    behind -> seconds), which prices a tree only while the draft is behind (see_chain's count)."""
    ctl = TreeController(list(RUNGS))
    ctl.draft.add(3, 3 * LEVEL)  # a level: LEVEL
    top = RUNGS[-1]
    for behind in (10, 30, 20):  # each caught-up wait: the levels and 0.1 ms a token behind
        ctl.record_forward(top.nodes + 1, FIXED + ROW * (top.nodes + 1))
        ctl.record_spec(top, None, {top: 1}, catchup=(behind, LEVEL * top.depth + 1e-4 * behind))
    assert ctl.catchup(40) == pytest.approx(4e-3)
    ctl.see_chain(None, 0)  # within a run of trees: none
    tree, plain = ctl.step_seconds(top), ctl.step_seconds(PLAIN)
    ctl.see_chain(None, 40)
    assert ctl.step_seconds(top) == pytest.approx(tree + 4e-3)
    assert ctl.step_seconds(PLAIN) == plain  # (a step without a tree: nothing to catch up on)
    ctl.see_chain(None, -3)  # (the engine's count after a snapshot feed: never negative)
    assert ctl.behind == 0


@pytest.mark.parametrize("seed", [1, 3])
def test_rungs_trading_places_after_a_probe_of_the_top_do_not_restart_the_probes(seed):
    """Acceptance replayed at 3 with GPU-like costs (a row nearly free): the 4-node tree misses a
    level now and then where the 8-node one does not, so the two trade places after some probes of
    the full tree. That probe measured every rung at once: its interval doubles whatever it found
    (a reset after each trade probed the full tree every ~5 steps on an H200)."""
    import random

    # (probe_every_s: no cap in seconds, which would stop the doubling at 2 s of steps: test_probe_schedule.py)
    rng, ctl, chosen = random.Random(seed), TreeController(list(RUNGS), probe_every_s=math.inf), []
    for _ in range(600):
        r = ctl.choose()
        ctl.record_forward(r.nodes + 1, FIXED + 0.00002 * (r.nodes + 1))
        if r.plain:
            ctl.record_plain()
        else:
            miss = rng.random() < 0.15
            ctl.record_spec(r, LEVEL * r.depth, {q: 2.0 if q.nodes == 4 and miss else 3.0 for q in ctl.rungs[1:]
                                                 if q.nodes <= r.nodes and q.depth <= r.depth})
        chosen.append(r)
    probes = [i for i, r in enumerate(chosen) if r == RUNGS[-1]][2:]  # after the warm-up's two
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 4 and all(g2 >= 2 * g1 - 1 for g1, g2 in zip(gaps, gaps[1:])), probes
    assert {r for r in chosen[100:] if r != RUNGS[-1] and not r.plain} <= {Rung(4, 3), Rung(8, 3)}
