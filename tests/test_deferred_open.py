"""A session that can take no tree before its next probe opens its draft only some steps before it
(draft_link.DraftLink.defers_open; docs/architecture.md, "Adaptive speculation", *Deferred open*):
a request that ends first never opens it; one whose probe comes opens it in time and verifies the
probe's tree; both decode exactly what plain decoding does (float64)."""

import threading
import time
from dataclasses import replace

import pytest

from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.costs import Costs, LinearCost
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from helpers import warm_until_costs

TREE = TreeConfig(16, 6, 4)
PROMPT = [(7 * i + 3) % 200 for i in range(40)]


class CountingWorker(DraftWorker):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.opened: list[str] = []

    gate = None  # an open waits for it (a long prompt's prefill on a GPU, spanning several rounds)
    waiting = 0  # opens waiting for the gate

    def open(self, session_id, *a, **kw):
        self.opened.append(session_id)
        if self.gate is not None:
            self.waiting += 1
            self.gate.wait(10)
            self.waiting -= 1
        return super().open(session_id, *a, **kw)


def slow_draft_costs(costs, probe_every: int, since_probe: int = 0):
    """`costs` (an engine's carried ones) with a draft level at 1 s: no tree could beat a plain step
    fully accepted by WARM_MARGIN, so the next session skips the warm-up tree and takes none before
    its probe, `probe_every - since_probe` steps in."""
    draft = LinearCost(proportional=True)
    draft.add(1, 1.0)
    return replace(costs, draft=draft, probe_every=probe_every, since_probe=since_probe)


@pytest.fixture
def injected(monkeypatch):
    """The probe schedule as a test injects it: price_open (tested on its own below) would raise an
    injected schedule to what the injected costs give."""
    from specextend.controller import TreeController

    monkeypatch.setattr(TreeController, "price_open", lambda self, open_s: None)


@pytest.fixture
def rig(tiny_models):
    target, draft = tiny_models("float64")
    params = SamplingParams(40, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(PROMPT, params)
    worker = CountingWorker(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive"), target, worker)
    warm_until_costs(engine, PROMPT, params, ref)
    del worker.opened[:-1]  # (the tests count opens from here: the rig's own, once)
    assert len(worker.opened) == 1 and engine.open_costs.known and engine._costs is not None
    yield engine, worker, params, ref
    worker.shutdown()


def test_a_request_that_ends_before_its_probe_never_opens_the_draft(rig):
    engine, worker, params, ref = rig
    engine._costs = slow_draft_costs(engine._costs, probe_every=1000)
    tokens, _, stats = engine.generate(PROMPT, params)
    assert tokens == ref
    assert len(worker.opened) == 1  # no open for this session
    assert stats.draft_open_s == 0.0 and stats.open_steps == 0 and not stats.fallback
    assert stats.plain_steps + stats.lookup_steps >= len(ref) - 1 - stats.lookup_accepted  # every step without a tree
    assert engine._costs.since_probe > 0  # the schedule went on: the probe comes in a later session
    engine.defer_opens = False
    engine._costs = slow_draft_costs(engine._costs, probe_every=1000)
    assert engine.generate(PROMPT, params)[0] == ref
    assert len(worker.opened) == 2  # without deferral the same session opens the draft


def test_no_open_for_a_probe_past_the_requests_end(rig, injected):
    """The open's lead reaches into the request but its probe does not (at most 40 steps, the probe
    60 steps in): the draft is not opened only to be closed unused."""
    from specextend.ladder import PLAIN

    engine, worker, params, ref = rig
    engine._costs = slow_draft_costs(engine._costs, probe_every=60)
    ctl = engine.new_controller(TREE)
    ctl.start_from(engine._costs)
    engine.open_costs.record(len(PROMPT), 43 * ctl.step_seconds(PLAIN))  # a lead of ~45 steps
    assert engine.defers_open(ctl, len(PROMPT)) and not engine.open_due(ctl, len(PROMPT), 1000)
    ctl.since_probe = 30  # 30 steps in: the probe within the lead, due in a request with 31+ tokens left
    assert engine.open_due(ctl, len(PROMPT), 1000) and not engine.open_due(ctl, len(PROMPT), 30)
    ctl.since_probe = 55  # the probe due in 5 steps, but the open takes ~45: not with 30 tokens left
    assert engine.open_due(ctl, len(PROMPT), 1000) and not engine.open_due(ctl, len(PROMPT), 30)
    ctl.since_probe = 30
    tokens, _, stats = engine.generate(PROMPT, params)
    assert tokens == ref and len(worker.opened) == 1 and stats.open_steps == 0


def test_a_probe_due_within_the_request_finds_the_draft_opened(rig, injected, monkeypatch):
    from specextend.ladder import PLAIN

    engine, worker, params, ref = rig
    engine._costs = slow_draft_costs(engine._costs, probe_every=25)
    ctl = engine.new_controller(TREE)
    ctl.start_from(engine._costs)
    # an open's lead of ~7 steps, whatever the cold open took (beside a busy CI host's other tests it
    # took long enough that the lead passed the request's end, and the draft was never opened) ...
    engine.open_costs.record(len(PROMPT), 5 * ctl.step_seconds(PLAIN))
    # ... and whatever the session's plain steps take (the lead is the open's seconds over the session's
    # own plain step: under two CPU hogs a plain step priced several times below the carried one
    # stretched it past the request's end once; the lead's arithmetic is tested above)
    monkeypatch.setattr(engine, "_open_lead", lambda ctl, prompt_tokens: 7)
    tokens, _, stats = engine.generate(PROMPT, params)
    assert tokens == ref
    assert len(worker.opened) == 2 and stats.draft_open_s > 0.0
    assert stats.step_kinds.get("tree", [0])[0] >= 1  # the probe's tree was verified
    assert stats.probe_steps >= 1


def test_no_deferral_without_carried_costs_or_with_an_overlapping_draft(tiny_models):
    from specextend.ladder import PLAIN
    from specextend.open_costs import OpenCosts

    target, draft = tiny_models("float64")
    params = SamplingParams(24, ignore_eos=True)
    worker = CountingWorker(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive"), target, worker)
    ctl = engine.new_controller(TREE)
    assert not engine.defers_open(ctl, len(PROMPT))  # no open timed yet
    warm_until_costs(engine, PROMPT, params)
    ctl = engine.new_controller(TREE)
    assert not engine.defers_open(ctl, len(PROMPT))  # a cold controller: its warm-up trees come at once
    ctl.start_from(slow_draft_costs(engine._costs, probe_every=1000))
    assert ctl.first_tree_in() == 1000 and engine.defers_open(ctl, len(PROMPT))
    # a prompt no open near its length has timed: at once (the open times its own length)
    assert not engine.defers_open(ctl, 100 * len(PROMPT))
    timed = engine.open_costs
    engine.open_costs = OpenCosts()
    engine.open_costs.record(len(PROMPT), 2000 * ctl.step_seconds(PLAIN))
    assert not engine.defers_open(ctl, len(PROMPT))  # an open longer than the steps before the probe: at once
    engine.open_costs = timed
    overlap = Engine(EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive", draft_overlap=True), target, worker)
    overlap.open_costs = engine.open_costs
    assert not overlap.defers_open(ctl, len(PROMPT))  # its own device: an open costs the target nothing
    worker.shutdown()


def synthetic_costs(level_s: float, probe_every: int) -> Costs:
    """Carried costs of a 1-ms plain forward (+10 us a row) and a draft level of `level_s`."""
    forward = LinearCost()
    forward.add(1, 1e-3)
    forward.add(17, 1.16e-3)
    draft = LinearCost(proportional=True)
    draft.add(1, level_s)
    return Costs(forward, draft, 1e-3, 0.0, 0.0, since_probe=0, probe_every=probe_every)


def test_a_deferred_open_spaces_the_probes_by_its_cost(rig):
    """The probe that a deferred open waits for costs the open too: a carried schedule is raised to
    the interval that the session's costs give with the open's seconds added to the probe's
    (controller_carry.Carrying.price_open), so that where trees do not pay a draft's open is paid
    as rarely as its probes are worth."""
    engine = rig[0]
    ctl = engine.new_controller(TREE)
    ctl.start_from(synthetic_costs(0.85e-3, probe_every=40))  # no warm-up tree, yet trees could pay a little
    assert ctl.first_tree_in() == 40  # primed, no warm-up tree: its first tree is the probe, 40 steps in
    best = ctl.best()
    probe = ctl._probe_rung(best)
    before = ctl.interval(best, probe)
    assert best.plain and before < ctl.max_probe
    ctl.price_open(0.06)  # an open as long as 60 plain steps
    after = ctl.interval(best, probe)
    assert after > before and ctl.probe_every == max(40, after) and ctl.first_tree_in() == max(40, after)
    ctl.no_open()
    assert ctl.open_s == 0.0 and ctl.interval(best, probe) == before
    hopeless = engine.new_controller(TREE)  # a draft no probe could make pay: the open waits max_probe steps
    hopeless.start_from(synthetic_costs(1.0, probe_every=40))
    hopeless.price_open(0.06)
    assert hopeless.probe_every == hopeless.max_probe
    cold = engine.new_controller(TREE)  # not primed: nothing carried to raise; choose() counts the open
    cold.price_open(0.06)
    assert cold.probe_every == 0 and cold.open_s == 0.06


def test_sessions_held_to_trees_open_their_deferred_drafts_and_take_trees(rig, monkeypatch, tmp_path):
    """A batch whose sessions deferred their opens (no tree before a probe 1,000 steps away) and that
    the batch's governor holds to trees (governor.py: its trees window, or a trees verdict) opens
    their drafts at once and verifies trees: before, each session waited for its own probe, so the
    governor's trees window measured plain steps. Every output equals plain decoding (float64)."""
    from specextend import round_log
    from specextend.governor import OPENING, TREES
    from test_batch import run_batched
    from test_governor_batched import TreesWin

    from specextend.ladder import PLAIN

    engine, worker, params, ref = rig
    engine._costs = slow_draft_costs(engine._costs, probe_every=1000)
    ctl = engine.new_controller(TREE)
    ctl.start_from(engine._costs)
    engine.open_costs.record(len(PROMPT), 3 * ctl.step_seconds(PLAIN))  # an open's lead of ~5 steps
    reqs = [(PROMPT, params, {}) for _ in range(4)]
    free, _ = run_batched(engine, reqs, max_batch=4)  # (no governor: every session defers, none opens)
    assert [tokens for tokens, _, _ in free] == [ref] * 4 and len(worker.opened) == 1
    engine._costs = slow_draft_costs(engine._costs, probe_every=1000)
    # (life_factor 0: measured whatever its opens cost, Governor._opens_pay)
    gov = TreesWin(window=2, hold=1000, life_factor=0.0)
    monkeypatch.setenv(round_log.ENV, str(tmp_path))
    engine.join_early = True  # (as served: plain steps while the open runs)
    worker.gate, rounds = threading.Event(), [0]

    def on_held(regime):  # the opens end after three rounds held while one waited
        rounds[0] += worker.waiting > 0
        if rounds[0] >= 3:
            worker.gate.set()

    # (longer requests: beside the rounds the opens took up to 40 tokens' rounds on a loaded 2-core host)
    longer = SamplingParams(120, ignore_eos=True)
    ref = Engine(EngineConfig(mode="ar"), engine.target).generate(PROMPT, longer)[0]
    held, b = run_batched(engine, [(PROMPT, longer, {}) for _ in range(4)], max_batch=4, governor=gov,
                          on_held=on_held)
    assert [tokens for tokens, _, _ in held] == [ref] * 4
    assert gov.verdicts[4].regime == "trees" and b.held_rounds["trees"] > 4
    assert len(worker.opened) == 1 + 4  # each session opened its draft when held to trees
    assert all(stats.step_kinds.get("tree", [0])[0] >= 1 for _, _, stats in held)
    # while a draft opened, the rounds held to trees stepped every session plainly ("opening"): the
    # rounds with trees began once every draft was open
    regimes = [r["regime"] for r in round_log.read(str(tmp_path))]
    assert OPENING in regimes and TREES in regimes[regimes.index(OPENING):]


def test_an_open_is_priced_from_the_opens_timed_near_its_length():
    """open_costs.OpenCosts: a short prompt's open is mostly fixed costs, so its seconds per token do
    not price a long prompt's open (scaled, a 16-token open of ~20 ms priced a 16K one at 20 s where
    it takes 158-180 ms: the deferred open never came due); opens price prompts within SPAN times their
    length, scaled by the ratio of lengths, the nearest first."""
    from specextend.open_costs import SPAN, OpenCosts

    costs = OpenCosts()
    assert not costs.known and costs.seconds(16) is None
    costs.record(16, 0.020)
    assert costs.known and costs.seconds(16) == pytest.approx(0.020)
    assert costs.seconds(64) == pytest.approx(0.080) and costs.seconds(int(16 * SPAN) + 1) is None
    assert costs.seconds(16384) is None and costs.seconds(4) == pytest.approx(0.005)
    costs.record(16384, 0.045)
    assert costs.seconds(16384) == pytest.approx(0.045) and costs.seconds(32768) == pytest.approx(0.090)
    assert costs.seconds(20) == pytest.approx(0.025)  # the nearest timed open prices it, not the latest
    assert costs.seconds(512) is None  # 32x from both
    costs.record(17000, 0.051)  # the latest in a power-of-two bucket replaces the one before
    assert costs.seconds(16384) == pytest.approx(0.051 * 16384 / 17000)


def test_a_batch_held_to_trees_waits_for_its_drafts_opens(rig, monkeypatch, tmp_path):
    """Batcher(wait_opens=True), as a replica whose draft shares its process and device: the round
    held to trees while drafts open (OPENING) first waits for the opens, so they run alone instead of
    beside plain rounds (on an H200 four 16K opens of the 0.5B draft beside the batch's rounds were
    still under way after 247 rounds, 1.1 s; waited for, all four took 0.81 s). The sessions then take
    trees at once; every output equals plain decoding (float64)."""
    from specextend import round_log
    from specextend.governor import OPENING
    from specextend.ladder import PLAIN
    from test_batch import run_batched
    from test_governor_batched import TreesWin

    engine, worker, params, ref = rig
    engine._costs = slow_draft_costs(engine._costs, probe_every=1000)
    ctl = engine.new_controller(TREE)
    ctl.start_from(engine._costs)
    engine.open_costs.record(len(PROMPT), 3 * ctl.step_seconds(PLAIN))
    monkeypatch.setenv(round_log.ENV, str(tmp_path))
    engine.join_early = True
    worker.gate = threading.Event()

    def release():  # the opens take 0.3 s once all four have begun (the gate: their prefill)
        deadline = time.monotonic() + 60
        while worker.waiting < 4 and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(0.3)
        worker.gate.set()

    reqs = [(PROMPT, params, {}) for _ in range(4)]
    gov = TreesWin(window=2, hold=1000, life_factor=0.0)
    threading.Thread(target=release, daemon=True).start()
    held, b = run_batched(engine, reqs, max_batch=4, governor=gov, wait_opens=True)
    assert [tokens for tokens, _, _ in held] == [ref] * 4
    assert len(worker.opened) == 1 + 4 and gov.verdicts[4].regime == "trees"
    rounds = round_log.read(str(tmp_path))
    waits = [r for r in rounds if r.get("open_wait_s")]
    assert waits and sum(r["open_wait_s"] for r in waits) >= 0.2  # the batch waited for the opens...
    assert all(r["regime"] == OPENING for r in waits)
    assert sum(r["regime"] == OPENING for r in rounds) <= 2  # ...instead of stepping beside them
    for _, _, stats in held:  # each session stepped plainly at most while its open started, then took trees
        assert stats.open_steps <= 1 and stats.step_kinds.get("tree", [0])[0] >= 1


def test_a_deferred_session_tells_its_driver_what_its_open_would_cost(rig):
    """Load.open_s: a session whose open is deferred tells the driver its expected seconds (what a
    trees window would cost it: Batcher.opens_s, the governor's _opens_pay), and 0 once it opens."""
    from specextend.governor import TREES
    from specextend.session_calls import Load
    from test_batch import run_batched
    from test_governor_batched import TreesWin

    engine, worker, params, ref = rig
    engine._costs = slow_draft_costs(engine._costs, probe_every=1000)
    engine.open_costs.record(len(PROMPT), 0.123)  # (a lead of more steps than the request has: never due)
    loads = [Load() for _ in range(4)]
    out, _ = run_batched(engine, [(PROMPT, params, {"load": ld}) for ld in loads], max_batch=4)
    assert [tokens for tokens, _, _ in out] == [ref] * 4 and len(worker.opened) == 1
    assert [ld.open_s for ld in loads] == [pytest.approx(0.123)] * 4
    engine._costs = slow_draft_costs(engine._costs, probe_every=1000)
    engine.open_costs.record(len(PROMPT), 1e-4)  # (opens that pay: the trees window opens them)
    loads = [Load() for _ in range(4)]
    out, b = run_batched(engine, [(PROMPT, params, {"load": ld}) for ld in loads], max_batch=4,
                         governor=TreesWin(window=2, hold=1000, life_factor=0.0))
    assert [tokens for tokens, _, _ in out] == [ref] * 4 and b.held_rounds[TREES] > 0
    assert len(worker.opened) == 1 + 4 and [ld.open_s for ld in loads] == [0.0] * 4
    # no open timed near the prompt's length, the session held plain at its start (deferred): its prior,
    # the draft weights' share of its own target prefill
    from specextend.open_costs import OpenCosts
    from test_governor_batched import Verdict

    engine.open_costs, engine.draft_weight_ratio = OpenCosts(), 0.25  # (the draft's shape known)
    loads, seen = [Load() for _ in range(4)], []
    out, _ = run_batched(engine, [(PROMPT, params, {"load": ld}) for ld in loads], max_batch=4,
                         governor=Verdict(window=2, hold=1000), on_held=lambda r: seen.append([ld.open_s for ld in loads]))
    assert [tokens for tokens, _, _ in out] == [ref] * 4
    priced = next(row for row in seen if all(x > 0 for x in row))  # (before the trees window opened them)
    # each its rows' share of the forwards that carried its prompt (session_calls.OwnShare), below the
    # draft's share of its prefill's wall time, which the batch's other prompts stretched (the four
    # prompts shared one forward: a quarter of it each, where the wall time held all of it)
    assert all(0 < x < 0.25 * st.prefill_s / 2 for x, (_, _, st) in zip(priced, out))


def test_a_sessions_share_of_the_forwards_that_carried_its_calls():
    """session_calls.OwnShare through `metered`: a forward that the driver shared and timed counts by
    the session's rows; one it ran alone, by its own span."""
    import torch

    from specextend.session_calls import Load, OwnShare, metered
    from specextend.timing import Span

    class Call:
        def __init__(self, rows):
            self.ids = torch.zeros(rows, dtype=torch.long)

    def prefill():
        yield Call(3)
        yield Call(5)
        return "logits"

    load, share, seen = Load(), OwnShare(), []
    co = metered(prefill(), load, lambda rows, span: seen.append((rows, span)), share)
    next(co)
    load.sessions, load.rows, load.span = 4, 12, Span(0.010)  # (the driver: a shared forward of 12 rows)
    co.send(None)
    time.sleep(0.02)  # (alone: the session's own span, its host time here)
    with pytest.raises(StopIteration) as stop:
        co.send(None)
    assert stop.value.value == "logits" and [rows for rows, _ in seen] == [12, 5]
    assert 0.0025 + 0.02 <= share.seconds() < 0.0025 + 0.5


def test_an_in_process_open_reports_its_own_seconds_not_its_wait_behind_another(tiny_models):
    """DraftWorker.open returns the seconds its open ran on the worker's thread (jobs.JobWorker._answer),
    not the call's wall time: an open queued behind a slow one reports its own prefill, and the engine
    records that (open_costs.open_seconds), so a burst's opens, run one at a time, do not price the
    next burst's at their queueing."""
    from concurrent.futures import ThreadPoolExecutor

    from specextend.draft.base import DraftSessionParams
    from specextend.open_costs import open_seconds

    class SlowFirst(DraftWorker):
        def _open(self, job):
            if job.session_id == "slow":
                time.sleep(0.4)
            return super()._open(job)

    _, draft = tiny_models("float64")
    worker = SlowFirst(draft.decoder)
    params = DraftSessionParams(TREE, EngineConfig().retrieval, max_new_tokens=8)
    try:
        with ThreadPoolExecutor(2) as pool:
            slow = pool.submit(open_seconds, worker.open, "slow", PROMPT, params)
            time.sleep(0.05)  # (queued behind it)
            t0 = time.perf_counter()
            quick = pool.submit(open_seconds, worker.open, "quick", PROMPT, params).result()
            waited = time.perf_counter() - t0
            assert slow.result() >= 0.4
        assert waited >= 0.3 and quick < waited - 0.25, (quick, waited)
    finally:
        worker.shutdown()
