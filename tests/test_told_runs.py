"""Runs that tell (docs/architecture.md, "Overlapped drafting", runs that tell): with an overlapping
draft, runs ahead (lookup runs, runs of plain steps; forced on the CPU) are taken too and tell the
draft the tokens they read (draft_link.RunTells), or push them to a snapshot feed; lossless
(float64), every token sent once and in order, a failing tell leaves plain decoding, and the same
over a real server on 127.0.0.1."""

from __future__ import annotations

import pytest

from specextend.config import SamplingParams
from specextend.controller import TreeController
from specextend.draft.worker import DraftWorker
from specextend.draft_link import TELL_BOUND
from specextend.ladder import PLAIN, ladder

from test_told import Recorder, assert_calls_in_order, engine_for, prompt, recorded_run


class MostlyPlain(TreeController):
    """Plain steps (taken as runs ahead where they may be: no probe due), a tree after every 20 of them."""

    def choose(self, sessions=1):
        return self.top if self._tree_due() else PLAIN

    def plain_still_best(self, sessions):  # (asked between runs of plain steps)
        return not self._tree_due()

    def _tree_due(self):
        return self.plain_steps >= 20 * (self.spec_steps + self.unready_steps + 1)


def mostly_plain(rungs):
    return MostlyPlain(rungs, probe_every=10 ** 6)


@pytest.fixture
def taken(monkeypatch):
    """Each run_ahead answer of the engine (None: no run taken then)."""
    import specextend.engine_steps as engine_mod

    out, real = [], engine_mod.run_ahead
    monkeypatch.setattr(engine_mod, "run_ahead", lambda *a, **kw: out.append(real(*a, **kw)) or out[-1])
    return out


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("lookup", [0, 6], ids=["plain-runs", "lookup-runs"])
def test_runs_ahead_tell_an_overlapping_draft_their_tokens(pair, taken, sampling, lookup):
    """With an overlapping draft, runs ahead are taken too (lookup runs where the request has a
    context lookup, else runs of plain steps; forced on the CPU): the tokens each run's steps read go
    to the draft as tells (draft_link.RunTells), every token once and in order, lossless (float64),
    and the trees after a run find the draft told (ready_only asks)."""
    params = SamplingParams(60, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=5)
    ref, out, stats, draft = recorded_run(pair, mostly_plain, params, 0.001, lookup_ahead=True, lookup_tokens=lookup)
    runs = sum(r is not None for r in taken)
    assert out == ref
    assert runs >= 2  # runs were taken, with tells
    told = [b == TELL_BOUND for _, _, b in draft.calls]
    assert sum(told) == stats.told_steps > runs  # a run tells more than once
    assert_calls_in_order(draft, out, unsent=len(out) - sum(len(t) for _, t, _ in draft.calls))
    sent = [t for _, tokens, _ in draft.calls for t in tokens]
    assert len(sent) >= len(out) - 30  # all but the last run's or step's unsent tail
    trees = [b for _, _, b in draft.calls if b != TELL_BOUND]
    assert trees and all(b.ready_only for b in trees[1:])


def test_a_draft_failing_on_a_runs_tell_leaves_plain_decoding(pair):
    from helpers import make_engine

    params = SamplingParams(50, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker, fail_at=3)  # a tell from inside the first lookup run
    engine = engine_for(pair, draft, lookup_tokens=6)
    engine.lookup_ahead = True
    engine.new_controller = lambda tree: mostly_plain(ladder(tree))
    out, _, stats = engine.generate(prompt(), params)
    worker.shutdown()
    assert out == ref and stats.fallback
    assert max(s for s, _, _ in draft.calls) <= 5  # nothing asked of the draft once the failure surfaced


@pytest.mark.parametrize("lookup", [0, 6], ids=["plain-runs", "lookup-runs"])
def test_runs_ahead_feed_a_snapshot_draft_their_tokens(pair, taken, lookup):
    """With pool snapshots (every step's tokens to the draft at once, snapshot.DraftFeed) runs ahead
    are taken too and push each part read to the feed: lossless (float64), every token sent once
    and in order, one call at a time."""
    params = SamplingParams(60, ignore_eos=True)
    ref, out, stats, draft = recorded_run(pair, mostly_plain, params, 0.001, lookup_ahead=True, lookup_tokens=lookup,
                                          draft_snapshots="on")
    runs = sum(r is not None for r in taken)
    assert out == ref and not stats.fallback
    assert runs >= 2 and stats.told_steps == 0
    assert_calls_in_order(draft, out, unsent=30)
    assert len(draft.calls) > runs  # runs pushed their parts as they were read


@pytest.mark.parametrize("transport", ["grpc", "zmq"])
def test_runs_tell_a_draft_over_the_wire(pair, transport):
    """The two-GPU app's shape: the overlapping draft behind a real server on 127.0.0.1 (gRPC, or the
    ZeroMQ step channel); lookup runs (forced on the CPU) tell it their tokens through the client's
    start_step: lossless (float64), tells sent, steps decoded ahead, no fallback."""
    from helpers import make_engine
    from specextend.rpc import DraftServerThread, GrpcDraftBackend

    params = SamplingParams(60, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    with DraftServerThread(worker) as server:
        client = GrpcDraftBackend(server.address, transport=transport)
        engine = engine_for(pair, client, lookup_tokens=6)
        engine.lookup_ahead = True
        engine.new_controller = lambda tree: mostly_plain(ladder(tree))
        out, _, stats = engine.generate(prompt(), params)
        client.shutdown()
    worker.shutdown()
    assert out == ref and not stats.fallback
    assert stats.told_steps > 2 and stats.ahead_steps > stats.told_steps // 2
    assert stats.num_steps + stats.unready_steps > 0  # trees asked after runs
