"""Draft steps of several sessions batched (draft/batch.py, the worker's gathering in worker.py)
against each step run alone: the same trees and the same caches in float64, a failure kept to its
own step, and queued steps of different sessions gathered into one batch in arrival order."""

from __future__ import annotations

import threading

import pytest
import torch

from specextend.attention.backends import CAUSAL
from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionNotFound, DraftSessionParams, Retrieval, TreeBound
from specextend.draft.batch import BatchCounts, drive_batch, drive_each
from specextend.draft.session import DraftSession
from specextend.draft.worker import DraftWorker, Open, Step
from specextend.models.batch import ForwardCall

from test_draft_expand import RETRIEVAL, prompt

TREE = TreeConfig(12, 4, 3)


def sessions(draft, retrieval, overlap):
    params = DraftSessionParams(TREE, retrieval, max_new_tokens=80)
    # two levels drafted on a miss: with no background work between these steps, the pool a ready
    # step answers from is what a miss forwarded (the default one level forwards none)
    return [DraftSession(draft, prompt(n, i), params, prefill_chunk=64, overlap=overlap, sync_depth=2)
            for i, n in enumerate([30, 150, 70, 9])]


def next_accepted(tree, step, i):
    """Accept a prefix of the first branch (length varies by session and step) and a bonus token,
    every other time the branch's next token (a path the overlap pool may hold: a ready tree);
    session 2 at step 3 catches up on more tokens than a step accepts (plain steps)."""
    if i == 2 and step == 3:
        return [(5 * j + step) % 250 + 1 for j in range(11)]
    n = (step + i) % 3
    branch, node = [], 0
    while len(branch) <= n and node < len(tree.tokens):
        branch.append(tree.tokens[node])
        node = next((c for c in range(len(tree.tokens)) if tree.parents[c] == node), len(tree.tokens))
    if (step + i) % 2 == 0 and len(branch) > n:
        return branch[:n + 1]
    return branch[:n] + [(7 * step + 3 * i) % 250 + 1]


def step_args(step, i, accepted, retrieval):
    refresh = Retrieval((0, 2, 3), 8) if retrieval.enabled and step == 2 and i != 1 else None
    bound = TreeBound(nodes=5, depth=2) if i == 3 and step % 2 else None
    return step, accepted, refresh, bound


def caches(s):
    out = [s.work.length, s.work.data[..., :s.work.length, :].clone()]
    if s.store is not None:
        out += [s.store.length, s.store.data[..., :s.store.length, :].clone()]
    return out


def assert_same_caches(batched, alone, tol=1e-10):
    """Each batched session's caches (lengths exactly, contents within tol) equal its twin's."""
    for b, a in zip(batched, alone):
        for x, y in zip(caches(b), caches(a)):
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y, rtol=tol, atol=tol)
            else:
                assert x == y


def lockstep(draft, retrieval, overlap, steps, tol=1e-10, batch_levels=False):
    """Four sessions' steps driven batched and, on twin sessions, each alone, step after step:
    yields each step's trees and batch counts once they and the caches are found equal.
    `batch_levels`: drive_batch's (whole-tree graphs split into levels batched across sessions)."""
    batched, alone = sessions(draft, retrieval, overlap), sessions(draft, retrieval, overlap)
    accepted = [[7 + i] for i in range(4)]
    for step in range(steps):
        args = [step_args(step, i, accepted[i], retrieval) for i in range(4)]
        counts = BatchCounts()
        got = drive_batch(draft, [s.step_co(*a) for s, a in zip(batched, args)], counts, batch_levels)
        want = drive_each(draft, [s.step_co(*a) for s, a in zip(alone, args)])
        assert got == want
        assert_same_caches(batched, alone, tol)
        yield got, counts
        accepted = [next_accepted(t, step, i) for i, t in enumerate(got)]


@pytest.mark.parametrize("retrieval", [RetrievalConfig(), RETRIEVAL], ids=["plain", "retrieval"])
@pytest.mark.parametrize("overlap", [False, True])
def test_batched_steps_equal_each_alone(tiny_models, retrieval, overlap):
    draft = tiny_models("float64")[1].decoder
    ready = 0
    for got, counts in lockstep(draft, retrieval, overlap, 6):
        ready += sum(t.ready for t in got)
        if not all(t.ready for t in got):  # someone drafted: their forwards went in batches
            assert counts.calls > counts.forwards and max(counts.per_forward) > 1
    if overlap:
        assert ready > 0  # some steps were answered from the pool, inside the batch


def failing_after_one_forward(s, *args):
    """A step that fails after its first forward has run."""
    co = s.step_co(*args)
    result = yield next(co)
    co.close()
    raise RuntimeError(f"failed after a forward of {result[0].shape[0]} rows")


def bad_token_step(model, cache):
    """A step whose forward cannot run (a token id past the vocabulary)."""
    yield ForwardCall(torch.tensor([model.args.vocab_size + 5]), torch.tensor([cache.length]), cache, CAUSAL)
    return "unreachable"


def test_a_failing_step_fails_alone(tiny_models):
    draft = tiny_models("float64")[1].decoder
    batched, alone = sessions(draft, RETRIEVAL, False), sessions(draft, RETRIEVAL, False)
    args = [step_args(0, i, [7 + i], RETRIEVAL) for i in range(4)]
    extra = draft.new_cache(16)
    steps = [batched[0].step_co(*args[0]), failing_after_one_forward(batched[1], *args[1]),
             bad_token_step(draft, extra), batched[2].step_co(*args[2]), batched[3].step_co(*args[3])]
    got = drive_batch(draft, steps)
    want = drive_each(draft, [alone[i].step_co(*args[i]) for i in (0, 2, 3)])
    assert [got[0], got[3], got[4]] == want
    assert isinstance(got[1], RuntimeError) and "failed after a forward" in str(got[1])
    assert isinstance(got[2], (IndexError, RuntimeError))  # the embedding refused the id
    # the good steps go on batched, as if the bad ones had never been there
    acc = [next_accepted(t, 0, i) for i, t in zip((0, 2, 3), want)]
    args1 = [step_args(1, i, a, RETRIEVAL) for i, a in zip((0, 2, 3), acc)]
    got = drive_batch(draft, [batched[i].step_co(*a) for i, a in zip((0, 2, 3), args1)])
    assert got == drive_each(draft, [alone[i].step_co(*a) for i, a in zip((0, 2, 3), args1)])


class GatedWorker(DraftWorker):
    """Its job for session "gate" waits for `gate`: the jobs submitted meanwhile queue up."""

    def __init__(self, model, gate: threading.Event, **kw):
        self.gate = gate
        super().__init__(model, **kw)

    def _do(self, job):
        if isinstance(job, Open) and job.session_id == "gate":
            assert self.gate.wait(30)
            return None
        return super()._do(job)


def test_the_worker_gathers_queued_steps_of_different_sessions(tiny_models):
    draft = tiny_models("float64")[1].decoder
    params = DraftSessionParams(TREE, RETRIEVAL, max_new_tokens=80)
    gate = threading.Event()
    worker, ref = GatedWorker(draft, gate), DraftWorker(draft, max_batch=1)
    for w in (worker, ref):
        for i, n in enumerate([30, 150, 70, 9, 40]):
            w.open(f"s{i}", prompt(n, i), params)
    worker.submit(Open("gate", (1,), params))
    futs = [worker.submit(Step(f"s{i}", 0, (7 + i,))) for i in range(5)]
    futs[4].cancel()  # given up on while queued: never runs
    retry = worker.submit(Step("s0", 0, (7,)))  # the same session again: waits for the next batch
    missing = worker.submit(Step("nobody", 0, (7,)))
    retry3 = worker.submit(Step("s3", 0, (10,)))  # a retry carries the same step number
    before = worker.stats()
    gate.set()
    trees = [f.result(30) for f in futs[:4]]
    assert trees == [ref.step(f"s{i}", 0, [7 + i]) for i in range(4)]
    assert retry.result(30) == trees[0]  # a retried step: the same tree, applied once
    with pytest.raises(DraftSessionNotFound):
        missing.result(30)
    assert retry3.result(30) == trees[3]
    after = worker.stats()
    assert after.step_batches - before.step_batches == 2  # [s0..s3], then [s0 retry, nobody, s3 retry]
    assert after.batched_steps - before.batched_steps == 7
    assert after.step_calls > after.step_forwards  # one forward carried several sessions' calls
    assert worker.step("s4", 0, [11]) == ref.step("s4", 0, [11])  # the cancelled step never ran
    worker.shutdown()
    ref.shutdown()


def test_a_step_waits_briefly_for_the_sessions_that_stepped_recently(tiny_models):
    """With a gather wait, a step that arrives alone waits (up to gather_s) for the other sessions
    that stepped lately, and they run as one batch; a session stepping alone never waits. The wait
    here is long (5 s) so that waiting and not waiting cannot be confused on a loaded machine."""
    import time

    draft = tiny_models("float64")[1].decoder
    params = DraftSessionParams(TREE, RetrievalConfig(), max_new_tokens=80)
    worker, ref = DraftWorker(draft, gather_s=5.0), DraftWorker(draft, max_batch=1)
    for w in (worker, ref):
        w.open("a", prompt(40, 1), params)
    t = time.monotonic()
    assert worker.step("a", 0, [7]) == ref.step("a", 0, [7])
    assert worker.step("a", 1, [8]) == ref.step("a", 1, [8])  # only "a" stepped lately: no wait
    assert time.monotonic() - t < 2.5
    for w in (worker, ref):
        w.open("b", prompt(60, 2), params)
    assert worker.step("b", 0, [9]) == ref.step("b", 0, [9])  # waited for "a" (which did not come): 5 s
    before = worker.stats()
    first = worker.submit(Step("a", 2, (10,)))
    time.sleep(0.3)  # "b" arrives while "a" waits for it
    second = worker.submit(Step("b", 1, (11,)))
    assert first.result(30) == ref.step("a", 2, [10]) and second.result(30) == ref.step("b", 1, [11])
    after = worker.stats()
    assert (after.step_batches - before.step_batches, after.batched_steps - before.batched_steps) == (1, 2)
    worker.shutdown()
    ref.shutdown()
