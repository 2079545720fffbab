"""The whole tree expansion as one graph (draft/tree_graph.py) against the forward-per-level path.

A draft session whose model has tree graphs must draft the same trees (tokens, parents) and leave
the same working cache, committed and staged slots alike, as one drafting level by level through
the full-step graphs: on the CPU through the twin (the same sequence op by op, the prefix kernel in
Triton's interpreter), on CUDA through the captured graph too. With four sessions or more the
batched driver runs the expansions' levels batched instead, and each step still equals its own.
"""

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams, Retrieval, TreeBound
from specextend.draft.batch import BatchCounts, drive_batch
from specextend.draft.session import DraftSession
from specextend.draft.tree_graph import TreeGraphs
from specextend.models.full_graphs import FullStepGraphs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RETRIEVAL = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)


class LevelSession(DraftSession):
    """Drafts a forward per level, whatever the model has."""

    def _tree_graphs(self, tree):
        return None


def prompt(n, seed):
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def draft(tiny_models):
    """The tiny draft in float32 on DEVICE with full-step graphs (the twin on the CPU) and tree graphs."""
    dec = tiny_models("float32")[1].decoder
    saved = dec.graphs, dec.tree_graphs, dict(dec.graphed), dec.w, dec.rope
    dec.w, dec.rope = dec.w.to(DEVICE), dec.rope.to(DEVICE)
    dec.graphs = FullStepGraphs(dec, capture=False)
    dec.tree_graphs = TreeGraphs(dec.graphs)
    try:
        yield dec
    finally:
        dec.graphs, dec.tree_graphs, dec.graphed, dec.w, dec.rope = saved


def run_pair(dec, params, steps=4, overlap=False, bounds=(None,)):
    fast = DraftSession(dec, prompt(120, 1), params, overlap=overlap)
    slow = LevelSession(dec, prompt(120, 1), params, overlap=overlap)
    gen = torch.Generator().manual_seed(2)
    accepted = [7]
    for step in range(steps):
        bound = bounds[step % len(bounds)]
        retrieval = Retrieval(chunk_ids=[0, 3, 5, 9], chunk_size=8) if step == 2 and params.retrieval.enabled else None
        t_fast = fast.step(step, accepted, retrieval, bound)
        t_slow = slow.step(step, accepted, retrieval, bound)
        assert (t_fast.tokens, t_fast.parents) == (t_slow.tokens, t_slow.parents), step
        n = int(torch.randint(1, 4, (1,), generator=gen))  # accept a prefix of the first branch
        accepted = [t_fast.tokens[i] for i in range(min(n, len(t_fast.tokens)))] + [11 + step]
        staged = params.tree.depth * params.tree.topk * 4  # past every level's staged keys
        assert fast.work.length == slow.work.length
        torch.testing.assert_close(fast.work.data[:, :, :, :fast.work.length + staged],
                                   slow.work.data[:, :, :, :slow.work.length + staged], atol=0, rtol=0)
    return fast


@pytest.mark.parametrize("tree,retrieval", [(TreeConfig(12, 4, 3), RetrievalConfig()),
                                            (TreeConfig(9, 5, 2), RETRIEVAL)])
def test_tree_graph_equals_levels(draft, tree, retrieval):
    before = draft.tree_graphs.replays
    run_pair(draft, DraftSessionParams(tree, retrieval, max_new_tokens=64))
    assert draft.tree_graphs.replays - before == 4  # every step's expansion went through it


def test_tree_graph_with_bounds_and_overlap(draft):
    """Smaller trees per step (the adaptive policy's bound: a plan per shape) and overlap's wide
    expansion (more children kept per node) draft the same trees and pools."""
    params = DraftSessionParams(TreeConfig(10, 5, 3), RetrievalConfig(), max_new_tokens=64)
    fast = run_pair(draft, params, steps=3, bounds=(TreeBound(nodes=6, depth=3), None))
    assert {k.depth for k in draft.tree_graphs.plans} >= {3, 5}
    fast = run_pair(draft, params, steps=3, overlap=True)
    assert fast.pool is not None


def test_depth_one_and_full_cache_draft_level_by_level(draft):
    s = DraftSession(draft, prompt(30, 2), DraftSessionParams(TreeConfig(3, 1, 3), RetrievalConfig(), 64))
    assert s._tree_graphs(TreeConfig(3, 1, 3)) is None  # no level to forward
    assert s._tree_graphs(TreeConfig(3, 2, 3)) is draft.tree_graphs


@pytest.mark.parametrize("batch_levels", [False, True])
def test_batched_driver_runs_levels_for_many_sessions(draft, batch_levels):
    """By default each expansion runs whole (a TreeCall), however many sessions step together, and
    only the accepted tokens' forwards batch; with batch_levels, from four sessions on their levels
    are batched like any forward. Either way each step equals the session stepped alone."""
    params = DraftSessionParams(TreeConfig(8, 4, 2), RetrievalConfig(), max_new_tokens=32)
    for n in (2, 4):
        batched = [DraftSession(draft, prompt(60 + 7 * i, i), params) for i in range(n)]
        alone = [LevelSession(draft, prompt(60 + 7 * i, i), params) for i in range(n)]
        before = draft.tree_graphs.replays
        counts = BatchCounts()
        trees = drive_batch(draft, [s.step_co(0, [5 + i], None) for i, s in enumerate(batched)], counts,
                            batch_levels)
        for i, (tree, s) in enumerate(zip(trees, alone)):
            ref = s.step(0, [5 + i], None)
            assert (tree.tokens, tree.parents) == (ref.tokens, ref.parents)
        levels = batch_levels and n >= 4
        assert draft.tree_graphs.replays - before == (0 if levels else n)
        # rounds: the accepted tokens' forwards, then the expansions (whole, or 3 levels batched)
        assert counts.per_forward == ([n] * 4 if levels else [n, n])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_tree_graph_equals_twin(tiny_models, dtype):
    """The captured expansion replays the twin's sequence: the same trees and caches."""
    dec = tiny_models("float32")[1].decoder
    saved = dec.graphs, dec.tree_graphs, dec.w, dec.rope
    dec.w, dec.rope = dec.w.to("cuda", dtype), dec.rope.to("cuda")
    try:
        params = DraftSessionParams(TreeConfig(12, 4, 3), RETRIEVAL, max_new_tokens=64)
        results = []
        for capture in (True, False):
            dec.graphs = FullStepGraphs(dec, capture=True)
            dec.tree_graphs = TreeGraphs(dec.graphs, capture=capture)
            s = DraftSession(dec, prompt(120, 1), params)
            trees = [s.step(0, [7], None), s.step(1, [3, 9], None), s.step(2, [4], Retrieval([0, 2, 5], 8))]
            results.append(([(t.tokens, t.parents) for t in trees], s.work.data.clone()))
            assert (dec.tree_graphs.plans[next(iter(dec.tree_graphs.plans))].graph is not None) == capture
        assert results[0][0] == results[1][0]
        torch.testing.assert_close(results[0][1], results[1][1], atol=0, rtol=0)
    finally:
        dec.graphs, dec.tree_graphs, dec.w, dec.rope = saved
