"""Unready steps (overlap_miss=plain, docs/architecture.md "Overlapped drafting"): a draft that has no
tree ready answers an empty one and the target decodes that token plainly; lossless, counted, and
the adaptive policy stops asking a draft that is never ready."""

from __future__ import annotations

import time

import pytest

import torch

from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.base import DraftBackend, DraftError, DraftSessionParams, DraftTree, Retrieval, TreeBound
from specextend.draft.session import DraftSession
from specextend.engine import Engine

from test_overlap import grow
from test_overlap import prompt as random_prompt

TREE = TreeConfig(8, 4, 3)


class NeverReady(DraftBackend):
    """Answers every step with an empty tree (an overlapping draft that is always behind)."""

    def __init__(self, delay_s: float = 0.0):
        self.bounds, self.steps, self.delay_s = [], [], delay_s

    def open(self, session_id, prompt_ids, params):
        pass

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        self.bounds.append(bound)
        self.steps.append((step, tuple(accepted_tokens)))
        time.sleep(self.delay_s)  # the round trip of an answer
        return DraftTree(step=step, tokens=(), parents=())

    def close(self, session_id):
        pass


def prompt(n=40):
    return [(7 * i + 3) % 200 for i in range(n)]


# ------------------------------------------------------------------ the draft session

@pytest.fixture(scope="module")
def draft(tiny_models):
    return tiny_models("float64")[1].decoder


@pytest.mark.parametrize("retrieval", [False, True])
def test_an_unready_step_answers_empty_and_catches_up_after(draft, retrieval):
    """A miss with ready_only answers an empty tree with nothing forwarded; its catch-up and first
    level then run in `settle`, leaving the caches and the pool a drafting miss leaves."""
    from specextend.draft.batch import run_alone

    r = RetrievalConfig(enabled=retrieval, chunk_size=8, top_k=4, draft_prefill_window=0)
    params = DraftSessionParams(TREE, r, 64)
    lazy, eager = DraftSession(draft, random_prompt(), params, overlap=True), DraftSession(draft, random_prompt(), params, overlap=True)
    miss, sel = [255, 254], None
    if retrieval:
        sel = Retrieval((0, 2, 5, 7), 8)
    for s in (lazy, eager):
        s.step(0, [7], None)
        grow(s)
    length = lazy.work.length
    got = run_alone(lazy.step_co(1, miss, sel, TreeBound(ready_only=True)), draft)
    assert got.tokens == () and not got.ready and lazy.pool is None and lazy.work.length == length
    ref = eager.step(1, miss, sel, TreeBound(ready_only=False))
    assert ref.tokens and not ref.ready
    lazy.settle()
    assert lazy.work.length == eager.work.length and lazy.refreshes == eager.refreshes
    n = eager.work.length
    assert torch.equal(lazy.work.data[:, :, :, :n], eager.work.data[:, :, :, :n])
    assert lazy.pool.tokens == eager.pool.tokens and lazy.pool.scores == eager.pool.scores
    # the background goes on from there, and a later verdict in the pool is answered from it
    grow(lazy)
    first = next(i for i in range(len(lazy.pool)) if lazy.pool.depths[i] == 1 and lazy.pool.slots[i] >= 0)
    assert lazy.step(2, [lazy.pool.tokens[first]], None, TreeBound(ready_only=True)).ready
    # without overlap there is no pool to answer from: ready_only is ignored
    plain = DraftSession(draft, random_prompt(), params)
    plain.step(0, [7], None)
    assert len(plain.step(1, miss, sel, TreeBound(ready_only=True)).tokens) == TREE.nodes


def test_a_failed_catch_up_fails_the_next_step(draft, monkeypatch):
    params = DraftSessionParams(TREE, RetrievalConfig(enabled=False), 64)
    s = DraftSession(draft, random_prompt(), params, overlap=True)
    s.step(0, [7], None, TreeBound(ready_only=True))  # no pool yet: empty, then caught up
    assert s.pool is not None

    def broken(*a, **k):
        raise RuntimeError("injected")
        yield

    monkeypatch.setattr(DraftSession, "_forward_committed_co", broken)
    with pytest.raises(RuntimeError):
        s.step(1, [255, 254], None, TreeBound(ready_only=True))
    with pytest.raises(DraftError, match="could not catch up"):
        s.step(2, [3], None)


# ------------------------------------------------------------------ the engine

@pytest.mark.parametrize("miss", ["plain", "draft"])
def test_empty_trees_decode_plainly_and_each_step_is_applied_once(tiny_models, miss):
    target = tiny_models("float64")[0]
    params = SamplingParams(24, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt(), params)
    draft = NeverReady()
    cfg = EngineConfig(mode="sd", tree=TREE, tree_policy="fixed", overlap_miss=miss)
    out, _, stats = Engine(cfg, target, draft).generate(prompt(), params)
    assert out == ref
    assert stats.num_steps == 0 and stats.unready_steps == len(out) - 1 and stats.tree_ready_fraction == 0.0
    assert stats.target_wait_ms_per_step > 0 and stats.mean_acceptance_length == 1.0
    # step k carries the token of step k - 1's plain decode: the draft is never sent a token twice
    assert [s for s, _ in draft.steps] == list(range(len(out) - 1))
    assert [list(t) for _, t in draft.steps] == [[tok] for tok in out[:-1]]
    # ready_only from the second step on (the first finds no pool: it waits for a drafted tree)
    assert [b.ready_only for b in draft.bounds] == [miss == "plain" and s > 0 for s, _ in draft.steps]


def test_the_adaptive_policy_stops_asking_a_draft_that_is_never_ready(tiny_models, monkeypatch):
    target = tiny_models("float64")[0]
    params = SamplingParams(160, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt(), params)
    cfg = EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive")
    draft = NeverReady(delay_s=0.005)  # asking costs a round trip and never pays
    engine = Engine(cfg, target, draft)
    make = engine.new_controller

    def capped(tree):  # probes at most 16 steps apart: the interval from measured costs is the host's
        ctl = make(tree)  # (a 5 ms round trip against a fast host's plain step: over 160 steps)
        ctl.max_probe = 16
        return ctl

    monkeypatch.setattr(engine, "new_controller", capped)
    out, _, stats = engine.generate(prompt(), params)
    assert out == ref and stats.num_steps == 0
    assert stats.unready_steps > 0 and stats.plain_steps > 2 * stats.unready_steps
    # a step after plain ones (its call carries their tokens too) waits for a drafted tree: the
    # draft's pool cannot hold that verdict (it was not told about them)
    assert any(len(t) > 1 for _, t in draft.steps)
    assert [b.ready_only for b in draft.bounds] == [s > 0 and len(t) == 1 for s, t in draft.steps]


def test_adaptive_trees_with_an_overlapping_draft_stay_lossless(tiny_models):
    """The app's default on two GPUs: adaptive trees, overlap, unready steps plain. The first step
    and every step after plain ones wait for a drafted tree, so verifications happen."""
    from specextend.config import RetrievalConfig
    from specextend.draft.chaos import Chaos, ChaosDraft
    from specextend.draft.worker import DraftWorker

    target, draft = tiny_models("float64")
    params = SamplingParams(40, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt(70), params)
    worker = DraftWorker(draft.decoder, overlap=True)
    cfg = EngineConfig(mode="specextend", tree=TREE, retrieval=RetrievalConfig(chunk_size=8, top_k=10, every=2),
                       tree_policy="adaptive", draft_overlap=True, draft_snapshots="off")  # (asks: test_snapshot.py)
    out, _, stats = Engine(cfg, target, ChaosDraft(worker, Chaos(latency_s=0.01))).generate(prompt(70), params)
    assert out == ref and stats.num_steps >= 1
    worker.shutdown()


def test_replayed_verdicts_with_the_drafts_bonus_are_found_ready(tiny_models):
    """Acceptance replay (benchmarks, not lossless) with replay_bonus="draft": each verdict is the
    draft's best branch then its second choice, which an overlapping draft can have forwarded, so
    ready trees are used; the output is what the verdicts said."""
    from specextend.draft.chaos import Chaos, ChaosDraft
    from specextend.draft.worker import DraftWorker

    target, draft = tiny_models("float64")
    worker = DraftWorker(draft.decoder, overlap=True)
    cfg = EngineConfig(mode="sd", tree=TREE, tree_policy="fixed", draft_overlap=True)
    engine = Engine(cfg, target, ChaosDraft(worker, Chaos(latency_s=0.03)))
    out, _, stats = engine.generate(prompt(70), SamplingParams(30, ignore_eos=True), replay=[2], replay_bonus="draft")
    assert len(out) == 30 and stats.replayed and stats.ready_steps > 0
    assert all(a <= 2 for a in stats.accepted_per_step) and max(stats.accepted_per_step) == 2
    worker.shutdown()
