"""A draft that joins late (docs/architecture.md, "Adaptive speculation"): with the adaptive policy a
session decodes plainly while its draft's open (its prefill) still runs, and speculates once the
open is done, the draft catching up on the tokens decoded meanwhile. Lossless whatever the point of
joining (float64: equal to `ar`, greedy and seeded sampling); a failed open falls back to plain
decoding; an open that ends after the request leaves no draft session behind."""

from __future__ import annotations

import threading
import time

import pytest

from specextend.config import RetrievalConfig, SamplingParams, TreeConfig
from specextend.controller import AlwaysSpeculate
from specextend.ladder import ladder
from specextend.draft.base import DraftError
from specextend.draft.worker import DraftWorker

from helpers import make_engine


def prompt(n=80):
    return [(13 * i + 7) % 251 for i in range(n)]


class HeldOpen(DraftWorker):
    """Its open waits until the test releases it (after the session has emitted some tokens);
    `fail`: then it raises instead."""

    def __init__(self, *a, fail=False, **kw):
        super().__init__(*a, **kw)
        self.release, self.opened, self.fail = threading.Event(), threading.Event(), fail

    def open(self, session_id, prompt_ids, params):
        assert self.release.wait(30)
        try:
            if self.fail:
                raise DraftError("the draft's open failed")
            return super().open(session_id, prompt_ids, params)
        finally:
            self.opened.set()


def run(engine, draft, p, params, join_at):
    """Streams the request, releasing the draft's open once `join_at` tokens were emitted (and
    waiting for it to end, so that the session joins at its next step)."""
    out, stats = [], None
    for ev in engine.stream(p, params):
        out += ev.token_ids
        stats = ev.stats
        if len(out) >= join_at and not draft.release.is_set():
            draft.release.set()
            assert draft.opened.wait(30)
    return out, stats


@pytest.mark.parametrize("join_at", [1, 5, 17])
@pytest.mark.parametrize("kw", [dict(mode="sd", lookup_tokens=0), dict(mode="sd", lookup_tokens=4),
                                dict(mode="specextend", lookup_tokens=0,
                                     retrieval=RetrievalConfig(chunk_size=8, top_k=4, every=2))],
                         ids=["sd", "sd-lookup", "specextend"])
@pytest.mark.parametrize("overlap", [False, True, "snapshots"])
@pytest.mark.parametrize("sampling", [False, True])
def test_a_late_join_is_lossless(pair, ar_engine, join_at, kw, overlap, sampling):
    params = SamplingParams(40, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=3)
    ref, _, _ = ar_engine.generate(prompt(), params)
    draft = HeldOpen(pair[1].decoder, overlap=bool(overlap))
    engine = make_engine(pair, draft_backend=draft, tree=TreeConfig(8, 4, 2), tree_policy="adaptive",
                         draft_overlap=bool(overlap), join_early=True,
                         draft_snapshots="on" if overlap == "snapshots" else "off", **kw)
    engine.new_controller = lambda tree: AlwaysSpeculate(ladder(tree))  # every step after the join drafted
    try:
        out, stats = run(engine, draft, prompt(), params, join_at)
        assert out == ref
        # the steps before the join (a lookup chain may make one emit several tokens)
        assert 0 < stats.open_steps <= join_at - 1 if join_at > 1 else stats.open_steps == 0
        # it joined and speculated (asked for trees: with overlap a loaded host may find none ready)
        assert stats.num_steps + stats.unready_steps > 0 and not stats.fallback
        kinds = stats.step_kinds  # [steps, tokens, seconds] per kind: every decode step, once
        # (a loaded host's snapshots may hold no tree at any step: no "tree" kind, num_steps 0; a CI flake)
        assert kinds.get("tree", [0])[0] == stats.num_steps and kinds.get("open", [0])[0] == stats.open_steps
        assert sum(k[1] for k in kinds.values()) == len(out) - 1  # the first token is the prefill's
        assert stats.draft_open_s > 0 and stats.target_prefill_s > 0  # the open's time, as the target saw it
    finally:
        draft.shutdown()


def test_a_failed_open_met_while_decoding_falls_back(pair, ar_engine):
    params = SamplingParams(30, ignore_eos=True)
    ref, _, _ = ar_engine.generate(prompt(), params)
    draft = HeldOpen(pair[1].decoder, fail=True)
    engine = make_engine(pair, draft_backend=draft, tree_policy="adaptive", lookup_tokens=0, join_early=True)
    try:
        out, stats = run(engine, draft, prompt(), params, 4)
        assert out == ref and stats.fallback and stats.num_steps == 0 and stats.open_steps == 3
    finally:
        draft.shutdown()


def test_an_open_that_ends_after_the_request_leaves_no_session(pair, ar_engine):
    params = SamplingParams(12, ignore_eos=True)
    ref, _, _ = ar_engine.generate(prompt(), params)
    draft = HeldOpen(pair[1].decoder)
    engine = make_engine(pair, draft_backend=draft, tree_policy="adaptive", lookup_tokens=0, join_early=True)
    try:
        out, stats = run(engine, draft, prompt(), params, 99)  # never released while it decodes
        assert out == ref and stats.open_steps == 11 and stats.num_steps == 0 and not stats.fallback
        assert stats.draft_open_s == 0  # never joined: no open time to report
        draft.release.set()
        assert draft.opened.wait(30)
        deadline = time.monotonic() + 10
        while draft.num_sessions and time.monotonic() < deadline:  # closed once its open ended
            time.sleep(0.01)
        assert draft.num_sessions == 0
    finally:
        draft.shutdown()


def test_the_engine_seeds_its_controller_from_the_drafts_open(tiny_models):
    """A draft whose open takes far longer than the target's prefill: the adaptive session decodes
    plainly while it runs (open_steps; it does not wait), then, seeded with that slow open's price,
    stays plain (output equals plain decoding); without that prior (the tests' default, conftest.py)
    the same pair speculates."""
    import threading
    import time as _time

    pair = tiny_models("float64")
    prompt, params = list(range(3, 90)), SamplingParams(30, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt, params)
    release, opened = threading.Event(), threading.Event()

    class SlowOpen(DraftWorker):
        def open(self, session_id, prompt_ids, params):
            assert release.wait(30)  # until the session has decoded some tokens without it
            _time.sleep(0.3)  # then slow: the tiny target prefills 87 tokens in milliseconds
            super().open(session_id, prompt_ids, params)
            opened.set()

    slow = SlowOpen(pair[1].decoder)
    engine = make_engine(pair, "sd", draft_backend=slow, tree_policy="adaptive", lookup_tokens=0, join_early=True,
                         prior_from_prefill=True)
    out, stats = [], None
    for ev in engine.stream(prompt, params):
        out += ev.token_ids
        stats = ev.stats
        if len(out) == 6:  # the open ends now, 24 tokens before the request does
            release.set()
            assert opened.wait(30)
    assert out == ref and stats.num_steps == 0
    assert stats.open_steps >= 5 and stats.plain_steps > 0  # plain before the join, and after it
    out, _, stats = make_engine(pair, "sd", tree_policy="adaptive", lookup_tokens=0).generate(prompt, params)
    assert out == ref and stats.num_steps > 0
    slow.shutdown()


def test_steps_during_the_open_teach_no_host_cost(pair, ar_engine, monkeypatch):
    """While the draft's open runs beside them (holding the host), plain and chain steps teach the
    lookup's gate their chains but not their host work, nor the policy its plain steps' host work
    or forwards (`contended`: they share the device with the open's prefill):
    on an H200 (2026-11-29) chain steps during a 1K open took 1.98 ms of host against 0.2 after it,
    the gate (carried to the next requests) then priced every chain out, and `specextend` decoded
    plainly at 0.84x `ar` where context lookup alone ran 1.59x. Lossless as ever."""
    from specextend import controller_record, lookup_gate

    learned, plain = [], []
    draft = HeldOpen(pair[1].decoder)
    seen = lookup_gate.LookupGate.observe_host
    monkeypatch.setattr(lookup_gate.LookupGate, "observe_host",
                        lambda self, *a, **kw: (learned.append(draft.opened.is_set()), seen(self, *a, **kw))[1])
    record = controller_record.Recording.record_plain
    monkeypatch.setattr(controller_record.Recording, "record_plain",
                        lambda self, step_s=None, lookup=0, contended=False: (
                            plain.append((draft.opened.is_set(), step_s, contended)),
                            record(self, step_s, lookup, contended))[1])
    params = SamplingParams(40, ignore_eos=True)
    ref, _, _ = ar_engine.generate(prompt(), params)
    engine = make_engine(pair, "sd", draft_backend=draft, tree=TreeConfig(8, 4, 2), tree_policy="adaptive",
                         lookup_tokens=4, join_early=True, plain_ahead=False)
    try:
        out, stats = run(engine, draft, prompt(), params, join_at=17)
        assert out == ref and stats.open_steps >= 10
        during = [(s, c) for opened, s, c in plain if not opened]
        assert len(during) == stats.open_steps and all(s is None and c for s, c in during)  # recorded, unpriced
        assert learned and all(learned)  # the gate learned host work only once the open was done
        assert any(s is not None and not c for opened, s, c in plain if opened)
    finally:
        draft.shutdown()
