"""Tree expansion with device-side bookkeeping (draft/expand.py) against its host twin.

Both must draft identical trees (tokens, parents, scores) step after step, leave identical draft
caches, and stop between forwards when asked; with retrieval on, through the step graphs' twin,
and in float32 as well as float64.
"""

import pytest
import torch

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams, Retrieval
from specextend.draft.expand import expand_tree, expand_tree_host, expand_tree_host_co, level_post
from specextend.models.graphed import Graphed
from specextend.draft.session import DraftSession
from specextend.models.full_graphs import FullStepGraphs
from specextend.models.graphs import StepGraphs

RETRIEVAL = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("tree,retrieval,graphs", [
    (TreeConfig(12, 4, 3), RetrievalConfig(), False),
    (TreeConfig(20, 6, 4), RETRIEVAL, False),
    (TreeConfig(9, 5, 2), RETRIEVAL, True),
])
def test_device_expansion_equals_host_twin(tiny_models, dtype, tree, retrieval, graphs):
    draft = tiny_models(dtype)[1].decoder
    params = DraftSessionParams(tree, retrieval, max_new_tokens=64)
    saved = draft.graphs
    draft.graphs = StepGraphs(draft, capture=False) if graphs else None
    try:
        fast, slow = DraftSession(draft, prompt(150, 1), params), DraftSession(draft, prompt(150, 1), params)
        slow.expand_co = expand_tree_host_co
        gen = torch.Generator().manual_seed(2)
        accepted = [7]
        for step in range(5):
            t_fast, t_slow = fast.step(step, accepted, None), slow.step(step, accepted, None)
            assert t_fast == t_slow
            n = int(torch.randint(1, 4, (1,), generator=gen))  # accept a prefix of the first branch
            accepted = [t_fast.tokens[i] for i in range(min(n, len(t_fast.tokens)))] + [11 + step]
            if retrieval.enabled and step == 2:  # a refresh with a new selection
                r = Retrieval(chunk_ids=[0, 3, 5, 9], chunk_size=8)
                assert fast.step(9, [5], r) == slow.step(9, [5], r)
        torch.testing.assert_close(fast.work.data[:, :, :, :fast.work.length],
                                   slow.work.data[:, :, :, :slow.work.length], atol=0, rtol=0)
    finally:
        draft.graphs = saved


def test_expansions_agree_on_pool_and_stop(tiny_models):
    draft = tiny_models("float64")[1].decoder
    s = DraftSession(draft, prompt(40, 3), DraftSessionParams(TreeConfig(10, 5, 3), RetrievalConfig(), 64))
    root = s.forward_committed([9])
    cfg = TreeConfig(10, 5, 3)

    def forward(ids, positions, mask, staged):
        from specextend.models.decoder import ForwardOptions

        return draft.forward(ids, positions, s.work, mask, ForwardOptions(staged=staged))[0]

    L = s.work.length - 1
    fast = expand_tree(forward, root, cfg, L)
    slow = expand_tree_host(forward, root, cfg, L)
    assert fast == slow and len(fast[0]) == 3 + 4 * 9  # k at depth 1, then k x k per level
    calls = []
    assert expand_tree(forward, root, cfg, L, should_stop=lambda: calls.append(1) or len(calls) > 2) is None
    assert len(calls) == 3  # checked before each forward, stopped before the third


def test_level_bookkeeping_is_eager_without_captured_graphs(tiny_models):
    draft = tiny_models("float64")[1].decoder
    s = DraftSession(draft, prompt(40, 3), DraftSessionParams(TreeConfig(10, 5, 3), RetrievalConfig(), 64))
    saved = draft.graphs
    try:
        draft.graphs = None
        assert s._post() is level_post
        draft.graphs = StepGraphs(draft, capture=False)  # the twin of the graphs: op by op
        assert s._post() is level_post
    finally:
        draft.graphs = saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_graphed_level_bookkeeping_equals_eager(tiny_models, dtype):
    """Graphed(level_post) (captured at first use, then replayed) drafts the eager pool; sessions of one
    model share its graphs and still draft their host twin's trees."""
    draft = tiny_models(dtype)[1].decoder
    cfg = TreeConfig(10, 5, 3)
    s = DraftSession(draft, prompt(40, 3), DraftSessionParams(cfg, RetrievalConfig(), 64))
    root = s.forward_committed([9])

    def forward(ids, positions, mask, staged):
        from specextend.models.decoder import ForwardOptions

        return draft.forward(ids, positions, s.work, mask, ForwardOptions(staged=staged))[0]

    L = s.work.length - 1
    eager = expand_tree(forward, root, cfg, L)
    post = Graphed(level_post, draft.device)
    for _ in range(2):  # captures, then replays
        assert expand_tree(forward, root, cfg, L, post=post) == eager
    assert len(post.plans) == cfg.depth - 1 and post.replays == 2 * (cfg.depth - 1)
    assert draft.graphs is not None and draft.graphs.capture  # the loaded model's own graphs
    params = DraftSessionParams(TreeConfig(12, 4, 3), RETRIEVAL, max_new_tokens=64)
    fast = [DraftSession(draft, prompt(150, i), params) for i in (1, 2)]
    slow = [DraftSession(draft, prompt(150, i), params) for i in (1, 2)]
    for x in slow:
        x.expand_co = expand_tree_host_co
    for step in range(3):
        for f, sl in zip(fast, slow):  # the two sessions alternate through the shared graphs
            assert f.step(step, [7 + step], None) == sl.step(step, [7 + step], None)
    if isinstance(draft.graphs, FullStepGraphs):  # whole expansions as one graph (draft/tree_graph.py)
        assert draft.tree_graphs is not None and draft.tree_graphs.replays > 0
    else:
        assert level_post in draft.graphed and draft.graphed[level_post].replays > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_step_bound_drafts_the_smaller_tree(tiny_models, overlap):
    """A step's bound (the adaptive policy's choice) drafts exactly what a session configured with
    that tree drafts; the tree comes best first, so its prefixes are the smaller trees."""
    from specextend.draft.base import TreeBound
    from specextend.tree import node_depths

    draft = tiny_models("float64")[1].decoder
    big = DraftSession(draft, prompt(60, 4), DraftSessionParams(TreeConfig(16, 5, 3), RetrievalConfig(), 64),
                       overlap=overlap, sync_depth=0)
    small = DraftSession(draft, prompt(60, 4), DraftSessionParams(TreeConfig(6, 3, 3), RetrievalConfig(), 64))
    full = DraftSession(draft, prompt(60, 4), DraftSessionParams(TreeConfig(16, 5, 3), RetrievalConfig(), 64))
    got = big.step(0, [7], None, TreeBound(nodes=6, depth=3))
    want = small.step(0, [7], None)
    assert (got.tokens, got.parents) == (want.tokens, want.parents)
    assert len(got.tokens) == 6 and max(node_depths(got.parents)) <= 3
    whole = full.step(0, [7], None)
    assert all(p < i for i, p in enumerate(whole.parents))  # best first is topological
    # the bounded tree is the full tree's best nodes no deeper than the bound (what the controller's
    # acceptance estimates assume, ladder.prefix_accepts)
    shallow = [t for t, d in zip(whole.tokens, node_depths(whole.parents)) if d <= 3]
    assert list(got.tokens) == shallow[:6]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
def test_top_logprobs_equals_the_log_softmax_top_k(dtype, tol):
    """The fast path (top-k of the logits minus their log-sum-exp) against its twin, top-k of the
    float32 log-softmax: the same tokens (distinct logits here) and the same log-probabilities."""
    from specextend.draft.expand import top_logprobs

    g = torch.Generator().manual_seed(3)
    rows = [torch.randperm(200, generator=g) for _ in range(5)]
    logits = (torch.stack(rows).to(torch.float64) / 8).to(dtype)  # [5, 200], distinct and exact in bf16
    lp, ids = top_logprobs(logits, 8)
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    want = torch.topk(torch.log_softmax(logits.to(cd), -1), 8)
    assert torch.equal(ids, want.indices)
    assert torch.allclose(lp.to(cd), want.values, atol=tol, rtol=0)
    lp1, ids1 = top_logprobs(logits[0], 3)  # one row (the root)
    assert torch.equal(ids1, want.indices[0, :3])
