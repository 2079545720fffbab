"""Several sessions' whole tree expansions as one graph (draft/tree_batch.py) against each session's
own expansion: the same trees and the same working caches, committed and staged slots alike, on the
CPU through the twin (the op-by-op sequence of the graph), on CUDA through the captured graph too;
expansions of different shapes in one round go in groups of their shape."""

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams, Retrieval, TreeBound
from specextend.draft.batch import BatchCounts, drive_batch, drive_each
from specextend.draft.session import DraftSession

import test_tree_graph
from test_tree_graph import prompt

draft = test_tree_graph.draft  # the fixture: the tiny draft with full-step and tree graphs

RETRIEVAL = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)


def staged_equal(a: DraftSession, b: DraftSession, staged: int, tol: float) -> None:
    assert a.work.length == b.work.length
    torch.testing.assert_close(a.work.data[:, :, :, :a.work.length + staged],
                               b.work.data[:, :, :, :b.work.length + staged], atol=tol, rtol=tol)


@pytest.mark.parametrize("n,retrieval", [(2, RetrievalConfig()), (3, RETRIEVAL)])
def test_batched_expansions_equal_each_alone(draft, n, retrieval):
    """n sessions (3 pads to 4) of different prompts step together for four steps, a different
    count of accepted tokens each; every tree and cache equals the same session stepped alone."""
    tree = TreeConfig(12, 4, 3)
    params = DraftSessionParams(tree, retrieval, max_new_tokens=64)
    batched = [DraftSession(draft, prompt(90 + 13 * i, i), params) for i in range(n)]
    alone = [DraftSession(draft, prompt(90 + 13 * i, i), params) for i in range(n)]
    batches = draft.tree_graphs.batches
    before = (batches.replays, batches.sessions)
    accepted = [[7 + i] for i in range(n)]
    for step in range(4):
        ref = None if step != 2 or not retrieval.enabled else Retrieval(chunk_ids=[0, 3, 5], chunk_size=8)
        args = [(step, accepted[i], ref) for i in range(n)]
        counts = BatchCounts()
        got = drive_batch(draft, [s.step_co(*a) for s, a in zip(batched, args)], counts, batch_trees=True)
        want = drive_each(draft, [s.step_co(*a) for s, a in zip(alone, args)])
        assert [(t.tokens, t.parents) for t in got] == [(t.tokens, t.parents) for t in want], step
        for b, a in zip(batched, alone):
            staged_equal(b, a, tree.depth * tree.topk * 4, 1e-4)  # (float32: GEMMs over more rows)
        accepted = [list(t.tokens[:(step + i) % 2]) + [11 + step + i] for i, t in enumerate(got)]
    assert (batches.replays - before[0], batches.sessions - before[1]) == (4, 4 * n)
    assert any(k[1] == (4 if n == 3 else n) for k in batches.plans)  # (padded to a power of two)


def test_shapes_batch_apart(draft):
    """Four sessions, two of them bounded to a smaller tree: two batched expansions of two."""
    params = DraftSessionParams(TreeConfig(12, 4, 3), RetrievalConfig(), max_new_tokens=64)
    batched = [DraftSession(draft, prompt(70 + 9 * i, 10 + i), params) for i in range(4)]
    alone = [DraftSession(draft, prompt(70 + 9 * i, 10 + i), params) for i in range(4)]
    bounds = [None, TreeBound(nodes=6, depth=3), None, TreeBound(nodes=6, depth=3)]
    batches = draft.tree_graphs.batches
    before = (batches.replays, batches.sessions)
    args = [(0, [5 + i], None, b) for i, b in enumerate(bounds)]
    got = drive_batch(draft, [s.step_co(*a) for s, a in zip(batched, args)], batch_trees=True)
    want = drive_each(draft, [s.step_co(*a) for s, a in zip(alone, args)])
    assert [(t.tokens, t.parents) for t in got] == [(t.tokens, t.parents) for t in want]
    assert (batches.replays - before[0], batches.sessions - before[1]) == (2, 4)


def test_off_runs_each_alone(draft):
    params = DraftSessionParams(TreeConfig(12, 4, 3), RetrievalConfig(), max_new_tokens=64)
    sessions = [DraftSession(draft, prompt(50 + i, i), params) for i in range(3)]
    before = draft.tree_graphs.batches.replays, draft.tree_graphs.replays
    drive_batch(draft, [s.step_co(0, [3], None) for s in sessions])
    assert (draft.tree_graphs.batches.replays, draft.tree_graphs.replays) == (before[0], before[1] + 3)
