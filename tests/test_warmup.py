"""warm_up (specextend/warmup.py): after it, a request meets no decode-time forward shape that the
warm-up did not run (each shape is a CUDA graph captured and Triton kernels compiled on first use)."""

import pytest

from specextend.config import RetrievalConfig, SamplingParams, TreeConfig
from specextend.models.graphs import MAX_GRAPH_TOKENS
from specextend.warmup import warm_up

from specextend.draft.worker import DraftWorker
from helpers import make_engine


def _record(decoder, seen: set):
    """Records the graph key (models/graphs.ShapeKey's fields) of every small forward of decoder."""
    inner = decoder.forward

    def forward(input_ids, positions, cache, new_mask, opts=None):
        t = input_ids.shape[0]
        if t <= MAX_GRAPH_TOKENS and opts is not None:
            rows = 0 if opts.logits_rows is None else opts.logits_rows.numel()
            seen.add((t, opts.staged, rows, opts.capture_last, opts.store is not None))
        return inner(input_ids, positions, cache, new_mask, opts)

    decoder.forward = forward
    return lambda: setattr(decoder, "forward", inner)


@pytest.mark.parametrize("mode,policy,overlap,lookup", [("specextend", "adaptive", False, 0), ("sd", "fixed", False, 0),
                                                        ("specextend", "adaptive", True, 0),
                                                        ("specextend", "adaptive", False, 8),
                                                        ("specextend", "fixed", True, 8)])
def test_a_request_after_warm_up_meets_no_new_shape(tiny_models, monkeypatch, mode, policy, overlap, lookup):
    """With overlap too: the warm-up's requests wait for a drafted tree at every step (an unready
    step would decode plainly and leave that step's verify shape for a request to capture). With
    context lookup, trees grow by a chain (the second prompt repeats itself: chains from the start)."""
    from specextend.draft.session import DraftSession
    from specextend.draft.worker import DraftWorker

    monkeypatch.setattr(DraftSession, "pads_catch_up", staticmethod(lambda model: True))  # as with CUDA graphs
    target, draft = tiny_models("float32")
    retrieval = RetrievalConfig(enabled=mode == "specextend", chunk_size=8, top_k=4, every=3,
                                draft_prefill_window=32)
    engine = make_engine((target, draft), mode, DraftWorker(draft.decoder, overlap=overlap), tree=TreeConfig(16, 5, 4),
                         retrieval=retrieval, tree_policy=policy, draft_overlap=overlap, lookup_tokens=lookup)
    warm, later = set(), set()
    undo = [_record(m.decoder, warm) for m in (target, draft)]
    stats = warm_up(engine, list(range(3, 150)))
    assert not stats.fallback and stats.replayed and stats.unready_steps == 0
    for u in undo:
        u()
    assert {k[0] for k in warm} >= {5, 9, 17}  # the verify of every rung of the ladder (4, 8, 16 nodes + root)
    undo = [_record(m.decoder, later) for m in (target, draft)]
    looked_up = 0
    for prompt in (list(range(7, 200)), [5, 9, 11] * 40):
        looked_up += engine.generate(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))[2].lookup_nodes
    for u in undo:
        u()
    assert later and later <= warm, sorted(later - warm)
    assert (looked_up > 0) == (lookup > 0)


def test_the_warm_up_runs_each_size_at_its_deepest_and_every_depth_once():
    from specextend.ladder import Rung, ladder
    from specextend.warmup import _covering

    assert _covering(ladder(TreeConfig(16, 6, 4))[1:]) == [Rung(4, 4), Rung(8, 6), Rung(16, 6), Rung(4, 3)]
    assert _covering([Rung(8, 3), Rung(8, 4), Rung(16, 5)]) == [Rung(8, 4), Rung(16, 5), Rung(8, 3)]


def test_padded_catch_up_equals_one_plain_forward(tiny_models, monkeypatch):
    """The draft's catch-up on plain steps' tokens, in chunks padded to CATCH_UP rows (the pads'
    K/V staged, never committed), leaves the same caches and drafts the same tree as forwarding
    the tokens at once (float64)."""
    import torch

    from specextend.draft import session as ds
    from specextend.draft.base import DraftSessionParams

    _, draft = tiny_models("float64")
    params = DraftSessionParams(TreeConfig(8, 3, 2), RetrievalConfig(enabled=True, chunk_size=8, top_k=4,
                                                                     draft_prefill_window=32), max_new_tokens=200)
    prompt = list(range(3, 120))
    catch_up = [(7 * i) % 200 + 1 for i in range(45)]  # 45 tokens: chunks of 16, padded, and a partial one
    trees, caches, padded = [], [], []
    inner = ds.DraftSession._forward_committed_co

    def spy(self, ids, window=0, rows=0, graphs=True):
        padded.append(rows > len(ids))
        return (yield from inner(self, ids, window, rows, graphs))

    monkeypatch.setattr(ds.DraftSession, "_forward_committed_co", spy)
    monkeypatch.setattr(ds, "CATCH_UP", 16)
    for pads in (True, False):  # padded chunks (as with CUDA graphs); all tokens in one forward
        monkeypatch.setattr(ds.DraftSession, "pads_catch_up", staticmethod(lambda model, pads=pads: pads))
        s = ds.DraftSession(draft.decoder, prompt, params)
        s.step(0, [5], None)
        tree = s.step(1, catch_up, None)
        trees.append((tree.tokens, tree.parents))
        caches.append((s.work.length, s.work.data[:, :, :, :s.work.length].clone(),
                       s.store.length, s.store.data[:, :, :, :s.store.length].clone()))
    assert padded.count(True) == 1  # the 13-token tail, padded to 16 rows
    assert trees[0] == trees[1]
    (l0, w0, n0, s0), (l1, w1, n1, s1) = caches
    assert l0 == l1 and n0 == n1
    torch.testing.assert_close(w0, w1, atol=1e-12, rtol=0)
    torch.testing.assert_close(s0, s1, atol=1e-12, rtol=0)


@pytest.mark.parametrize("retrieval", [True, False])
def test_a_short_request_s_catch_up_is_padded_too(tiny_models, monkeypatch, retrieval):
    """A request of few tokens still has room for a padded catch-up (CATCH_UP rows past its last
    committed token): unpadded, each count of plain steps' tokens was a graph shape of its own,
    captured on the request's path."""
    from specextend.draft import session as ds
    from specextend.draft.base import DraftSessionParams

    _, draft = tiny_models("float32")
    seen = []
    inner = ds.DraftSession._forward_committed_co

    def spy(self, ids, window=0, rows=0, graphs=True):
        seen.append((len(ids), rows))
        return (yield from inner(self, ids, window, rows, graphs))

    monkeypatch.setattr(ds.DraftSession, "_forward_committed_co", spy)
    monkeypatch.setattr(ds.DraftSession, "pads_catch_up", staticmethod(lambda model: True))  # as with CUDA graphs
    params = DraftSessionParams(TreeConfig(8, 3, 2), RetrievalConfig(enabled=retrieval, chunk_size=8, top_k=4,
                                                                     draft_prefill_window=32), max_new_tokens=12)
    s = ds.DraftSession(draft.decoder, list(range(3, 120)), params)
    s.step(0, [5], None)
    seen.clear()
    s.step(1, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], None)  # ten plain steps' tokens, near the request's end
    assert seen[0] == (10, ds.CATCH_UP)


def test_verify_sizes_are_warmed_only_with_overlap_or_lookup_and_for_any_prompt(tiny_models):
    from specextend.warmup import warm_verify_sizes

    target, draft = tiny_models("float32")
    tree = TreeConfig(16, 5, 4)
    assert warm_verify_sizes(make_engine((target, draft), "sd", tree=tree, lookup_tokens=0), [5, 6, 7]) == 0
    # context lookup: a tree and a chain of up to 8 grafted onto it
    assert warm_verify_sizes(make_engine((target, draft), "sd", tree=tree, lookup_tokens=8), [5, 6, 7]) == 16 + 8
    over = make_engine((target, draft), "specextend", tree=tree, draft_overlap=True, lookup_tokens=0,
                       retrieval=RetrievalConfig(chunk_size=8, top_k=4, draft_prefill_window=32))
    seen: set = set()
    undo = _record(target.decoder, seen)
    assert warm_verify_sizes(over, [5, 6, 7]) == 2 * 16  # a prompt shorter than the tree: still every size
    undo()
    assert {k[0] for k in seen if k[3]} == set(range(2, 18)) and {k[0] for k in seen if not k[3]} >= set(range(2, 18))


def test_the_long_warm_up_request_meets_a_full_retrieval_budget_and_refreshes(tiny_models):
    from specextend.warmup import long_prompt_len, warm_long

    target, draft = tiny_models("float32")
    retrieval = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=32)
    engine = make_engine((target, draft), "specextend", tree=TreeConfig(8, 3, 3), retrieval=retrieval,
                         tree_policy="adaptive", prefill_chunk=64)
    n = long_prompt_len(engine)
    assert n == max(2 * 64, 32 + 8, (1 + 4 + 1 + 2) * 8) == 128  # two prefill chunks here
    stats = warm_long(engine, [5, 6, 7])
    assert stats.prompt_tokens == n and not stats.fallback
    assert stats.num_steps > 0 and stats.retrieval_refreshes >= 3
    assert stats.draft_cache_tokens >= 4 * 8  # the draft kept its whole budget (top_k chunks)


def test_the_warm_up_runs_under_a_small_max_tokens_limit_and_the_limit_still_binds_requests(tiny_models):
    """The warm-up's requests need up to (depth + 1) x refresh steps' tokens (over 100 for the app's
    default tree); an app whose users may ask for 8 tokens at most warms up all the same, and its
    users' requests stay bound."""
    from specextend.request_limits import RequestError
    from specextend.warmup import warm_long

    target, draft = tiny_models("float32")
    retrieval = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=3, draft_prefill_window=32)
    engine = make_engine((target, draft), "specextend", tree=TreeConfig(16, 6, 4), retrieval=retrieval,
                         tree_policy="adaptive", max_new_tokens=8)
    stats = warm_up(engine, list(range(3, 150)))
    assert not stats.fallback and stats.num_steps > 8
    assert warm_long(engine, [5, 6, 7]).num_steps > 8
    with pytest.raises(RequestError, match="max_tokens 9 exceeds the limit 8"):
        engine.generate(list(range(3, 40)), SamplingParams(max_new_tokens=9))
    assert len(engine.generate(list(range(3, 40)), SamplingParams(max_new_tokens=8, ignore_eos=True))[0]) == 8


def test_the_retrieval_scoring_is_warmed_at_each_length_the_context_holds(tiny_models, monkeypatch):
    """warm_scoring: the target's attention scoring (retrieval.score_chunks) runs once at each of
    SCORING_LENGTHS within the model's context that has more chunks than the budget (its kernels load
    at start-up, not in a request's first refresh); none where nothing is scored."""
    from specextend import retrieval, warmup

    target, draft = tiny_models("float32")
    r = RetrievalConfig(enabled=True, chunk_size=32, top_k=40, draft_prefill_window=64)
    engine = make_engine((target, draft), "specextend", retrieval=r)
    scored = []
    inner = retrieval.score_chunks

    def spy(q, lse, keys, scale, cfg):
        ids = inner(q, lse, keys, scale, cfg)
        scored.append((tuple(q.shape), tuple(keys.shape), ids.numel()))
        return ids

    monkeypatch.setattr(warmup, "score_chunks", spy)
    monkeypatch.setattr(warmup, "SCORING_LENGTHS", (512, 1024, 2048, 10**9))
    a = target.args
    assert 2048 <= target.max_context < 10**9
    assert warmup.warm_scoring(engine) == [2048]  # 512 and 1024: 16 and 32 chunks, within the 40 kept
    assert scored == [((a.num_heads, a.head_dim), (a.num_kv_heads, 2048, a.head_dim), 40)]
    for off in (make_engine((target, draft), "ar"),
                make_engine((target, draft), "specextend", retrieval=RetrievalConfig(enabled=False)),
                make_engine((target, draft), "specextend", retrieval=RetrievalConfig(enabled=True, select="recency"))):
        assert warmup.warm_scoring(off) == []
    assert len(scored) == 1


def test_open_lengths_price_every_prompt_up_to_the_limit():
    """open_costs.open_lengths: 1K, then SPAN times longer within the limit; every prompt from 256
    tokens to the limit is within SPAN of one of them, each in its own bucket (OpenCosts prices it)."""
    from specextend.open_costs import SPAN, OpenCosts, open_lengths

    assert open_lengths(100) == [100] and open_lengths(0) == []
    assert open_lengths(4096) == [1024, 4096]
    assert open_lengths(32704) == [1024, 4096, 16384]
    for limit in (1500, 16320, 131008, 300):
        costs = OpenCosts()
        for n in open_lengths(limit):
            costs.record(n, n * 1e-5)
        assert all(costs.seconds(n) is not None for n in range(min(int(1024 / SPAN), limit), limit + 1, 97))


def test_the_warm_up_times_the_draft_s_opens_and_prices_them_without_the_prior(tiny_models):
    """warm_opens: the draft's open of each open_lengths prompt is timed into the engine's OpenCosts
    (the shortest twice), each session closed after; a deferred open of any length is then priced
    from them, not from the prior (its own target prefill of 0 s would price it at 0). Engines that
    never defer opens (fixed trees, overlap) time none; a draft that cannot open stops it quietly."""
    from specextend import warmup
    from specextend.open_costs import open_lengths

    target, draft = tiny_models("float32")
    opened = []

    class Spy(DraftWorker):
        def open(self, session_id, prompt_ids, params):
            opened.append((session_id, len(prompt_ids), prompt_ids[0]))
            return super().open(session_id, prompt_ids, params)

    worker = Spy(draft.decoder)
    engine = make_engine((target, draft), "specextend", draft_backend=worker, tree_policy="adaptive",
                         max_prompt_tokens=5000)
    lengths = open_lengths(engine.max_prompt_tokens - 64)
    assert lengths == [1024, 4096]
    timed = warmup.warm_opens(engine, [5, 6, 7])
    assert [n for _, n, _ in opened] == lengths[:1] + lengths and sorted(timed) == lengths
    assert len({first for _, _, first in opened}) == len(opened)  # (no open loads another's prefix)
    assert not worker._sessions  # every one closed
    for n in (300, 1024, 2000, 4936, 16000):
        assert engine.open_costs.seconds(n) is not None and engine.open_prior(n, 0.0) > 0.0
    assert engine.open_prior(4096, 0.0) == pytest.approx(timed[4096]) and engine.open_costs.timed() == timed
    for never in (make_engine((target, draft), "specextend", tree_policy="fixed"),
                  make_engine((target, draft), "specextend", tree_policy="adaptive", draft_overlap=True)):
        assert warmup.warm_opens(never, [5, 6, 7]) == {} and not never.open_costs.known

    class Broken(DraftWorker):
        def open(self, session_id, prompt_ids, params):
            raise RuntimeError("out of memory")

    broken = make_engine((target, draft), "specextend", draft_backend=Broken(draft.decoder), tree_policy="adaptive")
    assert warmup.warm_opens(broken, [5, 6, 7]) == {} and not broken.open_costs.known
