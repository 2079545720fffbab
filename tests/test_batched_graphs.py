"""Batched full-step forwards (FullStepGraphs.forward_batch; docs/architecture.md, "Batched steps").

Several sessions' decode tokens or trees run as one forward: each session's rows attend over its
own cache (the prefix kernel's per-session meta) and over its own new keys only (a block-diagonal
tree mask). Against the one-session forward of each call through the same graphs' twin (on the
CPU the Triton kernels run in Triton's interpreter), and on CUDA the captured batch against it.
"""

import os

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.attention.backends import CAUSAL
from specextend.attention.triton_prefix import cache_meta, partials_reference, prefix_partials
from specextend.models.batch import ForwardCall, forward_batch, forward_each
from specextend.models.decoder import ForwardOptions
from specextend.models.full_graphs import FullStepGraphs, padded_sessions
from specextend.tree import ancestor_mask, node_depths

from test_graphs import decoder_on

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets Triton's interpreter on the CPU"


@pytest.mark.parametrize("sessions,tokens", [(3, 1), (2, 5)])
def test_prefix_partials_per_session_caches(sessions, tokens):
    """B sessions' rows, folded (query head of the group, session, token), each over its own cache
    of its own length (one of them empty: a padding session), equal the reference per session."""
    gen = torch.Generator().manual_seed(sessions)
    layers, g, r, d, splits = 2, 2, 3, 16, 4
    lengths = [70, 0, 33][:sessions] if sessions == 3 else [70, 19]
    caches = [torch.randn(layers, 2, g, cap, d, generator=gen).to(DEVICE) for cap in (96, 80, 64)[:sessions]]
    q = torch.randn(g, r, sessions, tokens, d, generator=gen).to(DEVICE)  # [G, R, B, T, D]
    anchor = torch.zeros(16, device=DEVICE)
    meta = torch.tensor([x for c, n in zip(caches, lengths) for x in cache_meta(c, anchor, n)], device=DEVICE)
    m = r * sessions * tokens
    out = torch.full((g, splits, m, d), float("nan"), device=DEVICE)
    lse = torch.full((g, splits, m), float("nan"), device=DEVICE)
    prefix_partials(q.reshape(g, m, d), anchor, meta, 1, 0.3, out, lse, block_n=16, min_chunk=16,
                    sessions=sessions, tokens=tokens)
    out = out.view(g, splits, r, sessions, tokens, d)
    lse = lse.view(g, splits, r, sessions, tokens)
    for b, (c, n) in enumerate(zip(caches, lengths)):
        ref_out, ref_lse = partials_reference(q[:, :, b].reshape(g, r * tokens, d), c[1, 0], c[1, 1], n, splits,
                                              0.3, block_n=16, min_chunk=16)
        torch.testing.assert_close(lse[:, :, :, b].reshape(g, splits, -1), ref_lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[:, :, :, b].reshape(g, splits, -1, d), ref_out, atol=1e-5, rtol=1e-5)


def _sessions(dec, lengths, seed):
    """A prefilled cache per session, and its twin for the one-by-one reference."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, dec.args.vocab_size, (n,), generator=gen).to(DEVICE)
        pair = []
        for _ in range(2):
            c = dec.new_cache(n + 40)
            dec.forward_eager(ids, torch.arange(n, device=DEVICE), c, CAUSAL, ForwardOptions())
            c.advance(n)
            pair.append(c)
        out.append(pair)
    return out


def _trees(dec, caches, step):
    """Each session's tree (its own shape and size: 4, 5, 3 tokens with the root) as a ForwardCall;
    the first captures its last layer."""
    parents = [[-1, 0, 0], [-1, -1, 1, 2], [-1, 0]]
    out = []
    for i, c in enumerate(caches):
        par = parents[i % 3]
        depths = torch.tensor([0] + node_depths(par), device=DEVICE)
        ids = (torch.arange(len(par) + 1, device=DEVICE) * 7 + 3 * i + step) % dec.args.vocab_size
        out.append(ForwardCall(ids, c.length + depths, c, ancestor_mask(par, DEVICE),
                               ForwardOptions(capture_last=i == 0)))
    return out


def float32_pair():
    """A fresh tiny (target, draft) pair in float32 (the Triton kernels' dtypes; tests attach graphs
    to it, so not the shared fixture's)."""
    from specextend.models.loader import load_model

    t = load_model("random:llama-tiny", dtype="float32", attention_backend="torch")
    d = load_model("random:llama-tiny-draft", role="draft", dtype="float32", attention_backend="torch",
                   vocab_size=t.args.vocab_size, target_weights=t.decoder.w)
    return t, d


@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))])
def test_batched_forward_equals_each(capture):
    """Three sessions (padded to four) of different lengths and capacities: decode tokens, then
    trees of different shapes and sizes (padded to the largest) with one capture, then a decode
    token beside trees, each round twice (plans reused at longer prefixes): each session's logits,
    capture and staged K/V equal its own forward."""
    dec = decoder_on("llama3", DEVICE, torch.float32)
    graphs = FullStepGraphs(dec, capture=capture)
    ref_graphs = FullStepGraphs(dec, capture=False)
    sessions = _sessions(dec, [20, 45, 9], seed=1)

    def check(mine, twins, staged):
        got = graphs.forward_batch(mine)
        ref = [ref_graphs.forward(c.ids, c.positions, c.cache, c.mask, c.opts) for c in twins]
        for (lg, cg), (lr, cr), c in zip(got, ref, mine):
            assert lg.shape == lr.shape == (c.ids.shape[0], dec.args.vocab_size)
            torch.testing.assert_close(lg, lr, atol=1e-4, rtol=1e-4)
            assert (cg is None) == (cr is None)
            if cg is not None:
                torch.testing.assert_close(cg.q, cr.q, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(cg.lse, cr.lse, atol=1e-5, rtol=1e-5)
        for c, t in zip(mine, twins):
            n = c.ids.shape[0]
            torch.testing.assert_close(c.cache.staged(0, n), t.cache.staged(0, n), atol=1e-5, rtol=1e-5)
            for cache in (c.cache, t.cache):
                cache.commit(torch.tensor(staged[:n], device=DEVICE))

    def decode(cache, i, step):
        return ForwardCall(torch.tensor([5 + step + i], device=DEVICE), torch.tensor([cache.length], device=DEVICE),
                           cache, CAUSAL)

    for step in range(2):
        check([decode(cb, i, step) for i, (cb, _) in enumerate(sessions)],
              [decode(ce, i, step) for i, (_, ce) in enumerate(sessions)], [0])
        check(_trees(dec, [cb for cb, _ in sessions], step), _trees(dec, [ce for _, ce in sessions], step), [0, 1])
        mixed = lambda caches: _trees(dec, caches[:2], step) + [decode(caches[2], 2, step)]  # noqa: E731
        check(mixed([cb for cb, _ in sessions]), mixed([ce for _, ce in sessions]), [0, 1])
    assert sorted(k.t // k.sessions for k in graphs.plans if k.sessions == 4) == [1, 5]
    assert graphs.forwards == graphs.batched_forwards == 6


def test_a_round_like_an_earlier_one_reuses_its_batched_mask():
    """forward_batch builds a round's mask once per combination of the calls' sizes and masks: a
    second round of plain steps (or of the same cached tree shapes) launches nothing for it and
    leaves the plan's mask buffer as it is; a new combination builds its own. Outputs as each alone."""
    from specextend.tree import ancestor_mask_cached

    dec = decoder_on("llama3", DEVICE, torch.float32)
    graphs, ref_graphs = FullStepGraphs(dec, capture=False), FullStepGraphs(dec, capture=False)
    sessions = _sessions(dec, [20, 45, 9], seed=3)

    def decode(cache, i, step):
        return ForwardCall(torch.tensor([5 + step + i], device=DEVICE), torch.tensor([cache.length], device=DEVICE),
                           cache, CAUSAL)

    def trees(caches, step):  # every session the same cached tree shape (a lookup chain's)
        par = [-1, 0, 1]
        return [ForwardCall((torch.arange(4, device=DEVICE) * 5 + i + step) % dec.args.vocab_size,
                            c.length + torch.tensor([0, 1, 2, 3], device=DEVICE), c,
                            ancestor_mask_cached(par, DEVICE)) for i, c in enumerate(caches)]

    seen = []
    for step in range(3):
        for make in (decode, None):
            mine = ([make(cb, i, step) for i, (cb, _) in enumerate(sessions)] if make else
                    trees([cb for cb, _ in sessions], step))
            twin = ([make(ce, i, step) for i, (_, ce) in enumerate(sessions)] if make else
                    trees([ce for _, ce in sessions], step))
            got = graphs.forward_batch(mine)
            for (lg, _), c in zip(got, twin):
                lr, _ = ref_graphs.forward(c.ids, c.positions, c.cache, c.mask, c.opts)
                torch.testing.assert_close(lg, lr, atol=1e-4, rtol=1e-4)
            plan = next(p for k, p in graphs.plans.items() if k.sessions == 4 and k.t == 4 * mine[0].ids.shape[0])
            seen.append(plan.mask_src)
            for c, t in zip(mine, twin):
                n = c.ids.shape[0]
                for cache in (c.cache, t.cache):
                    cache.commit(torch.arange(n, device=DEVICE))
    assert len(graphs._batch_masks) == 2  # one per combination met
    assert seen[0] is seen[2] is seen[4] and seen[1] is seen[3] is seen[5] and seen[0] is not seen[1]


def test_forward_batch_merges_shapes():
    """models/batch.forward_batch with full-step graphs: decode tokens, trees and a short causal
    chunk of five sessions run as one forward (each padded to the largest), a forward with a store
    runs on its own; every result equals the call run alone, eagerly."""
    dec = decoder_on("qwen2", DEVICE, torch.float32)
    dec.graphs = FullStepGraphs(dec, capture=torch.cuda.is_available())
    sessions = _sessions(dec, [12, 30, 17, 25, 8, 14], seed=2)
    mine, twin = [cb for cb, _ in sessions], [ce for _, ce in sessions]
    stores = [dec.new_cache(64), dec.new_cache(64)]

    def calls(caches, store):
        dec_calls = [ForwardCall(torch.tensor([3 + i], device=DEVICE), torch.tensor([c.length], device=DEVICE), c,
                                 CAUSAL) for i, c in enumerate(caches[:2])]
        trees = _trees(dec, caches[2:4], 0)
        chunk = caches[4]
        prefill = ForwardCall(torch.arange(6, device=DEVICE), torch.arange(chunk.length, chunk.length + 6,
                                                                            device=DEVICE), chunk, CAUSAL)
        s = caches[5]
        stored = ForwardCall(torch.arange(2, device=DEVICE), torch.arange(s.length, s.length + 2, device=DEVICE), s,
                             CAUSAL, ForwardOptions(store=store))
        return [trees[0], dec_calls[0], stored, prefill, dec_calls[1], trees[1]]

    before = dec.graphs.forwards
    got = forward_batch(dec, calls(mine, stores[0]))
    assert dec.graphs.batched_forwards == 1 and dec.graphs.forwards - before == 2  # the five; the stored one
    assert [k.sessions for k in dec.graphs.plans if k.sessions > 1] == [8]
    saved, dec.graphs = dec.graphs, None
    ref = forward_each(dec, calls(twin, stores[1]))  # eager, one by one
    dec.graphs = saved
    for (lg, cg), (lr, cr) in zip(got, ref):
        assert lg.shape == lr.shape
        torch.testing.assert_close(lg, lr, atol=1e-4, rtol=1e-4)
        assert (cg is None) == (cr is None)
    for cb, ce in sessions:
        n = cb.length + 6
        torch.testing.assert_close(cb.data[..., :n, :], ce.data[..., :n, :], atol=1e-5, rtol=1e-5)


def test_calls_the_graphs_take_alone_replay_them_one_by_one(monkeypatch):
    """Calls the step graphs take but cannot batch (the draft's accepted tokens: a retrieval store
    and one logits row) replay their graphs one by one, however many meet, never an eager batch;
    what no graph takes (chunks past the graphs' rows) still batches eagerly from GRAPHS_BATCH_MIN
    calls. Every result equals the call run alone, eagerly."""
    import specextend.models.batch as batch

    dec = decoder_on("qwen2", DEVICE, torch.float32)
    dec.graphs = FullStepGraphs(dec, capture=torch.cuda.is_available())
    n = batch.GRAPHS_BATCH_MIN
    big = dec.graphs.max_tokens + 6  # rows no graph takes

    def calls(seed):
        gen = torch.Generator().manual_seed(seed)
        out = []
        for i in range(2 * n):
            cache, store = dec.new_cache(200), dec.new_cache(200)
            t = 3 if i < n else big
            prompt = torch.randint(0, dec.args.vocab_size, (10 + i,), generator=gen).to(DEVICE)
            dec.forward_eager(prompt, torch.arange(10 + i, device=DEVICE), cache, CAUSAL, ForwardOptions(store=store))
            cache.advance(10 + i)
            store.advance(10 + i)
            ids = torch.randint(0, dec.args.vocab_size, (t,), generator=gen).to(DEVICE)
            opts = ForwardOptions(store=store, logits_rows=torch.tensor([t - 1], device=DEVICE)) if i < n else ForwardOptions()
            out.append(ForwardCall(ids, torch.arange(cache.length, cache.length + t, device=DEVICE), cache, CAUSAL, opts))
        return out

    eager_sizes = []
    real = batch.forward_eager_batch
    monkeypatch.setattr(batch, "forward_eager_batch", lambda m, cs: eager_sizes.append(len(cs)) or real(m, cs))
    before = dec.graphs.forwards
    mine = calls(3)
    got = forward_batch(dec, mine[:n] + mine[n:])
    assert dec.graphs.forwards - before == n  # the stored calls, each through its graph
    assert eager_sizes == [n]  # the chunks, one eager batch
    saved, dec.graphs = dec.graphs, None
    twin = calls(3)
    ref = forward_each(dec, twin)
    dec.graphs = saved
    for (lg, _), (lr, _) in zip(got, ref):
        assert lg.shape == lr.shape
        torch.testing.assert_close(lg, lr, atol=1e-4, rtol=1e-4)
    for c, r in zip(mine[:n], twin[:n]):  # the store written as alone
        s, sr = c.opts.store, r.opts.store
        torch.testing.assert_close(s.data[..., :s.length + 3, :], sr.data[..., :sr.length + 3, :], atol=1e-5, rtol=1e-5)


def test_batch_sizes():
    assert [padded_sessions(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    dec = decoder_on("llama3", "cpu", torch.float32)
    g = FullStepGraphs(dec, capture=False)
    assert g.max_batch(1) == 32 and g.max_batch(17) == 16 and g.max_batch(64) == 8
    cache = dec.new_cache(32)
    cache.length = 4
    call = ForwardCall(torch.tensor([1]), torch.tensor([4]), cache, CAUSAL)
    assert g.batch_key(call) == (0, 1)
    g.batch_shapes = frozenset({(0, 1), (0, 5), (0, 9), (2, 2)})
    tree = ForwardCall(torch.arange(3), torch.tensor([4, 5, 5]), cache, ancestor_mask([-1, -1], "cpu"))
    assert g.batch_key(tree) == (0, 5)  # pads to the smallest warmed count that holds it
    level = ForwardCall(torch.arange(2), torch.tensor([5, 6]), cache, torch.ones(2, 4, dtype=torch.bool),
                        ForwardOptions(staged=2))
    assert g.batch_key(level) == (2, 2)  # a draft level after two staged tree keys
    level.opts.staged = 4
    assert g.batch_key(level) is None  # no warmed shape after four
    assert g.batch_key(ForwardCall(torch.arange(10), torch.arange(4, 14), cache, CAUSAL)) is None
    assert g.batch_key(ForwardCall(torch.tensor([1]), torch.tensor([4]), cache, CAUSAL,
                                   ForwardOptions(logits_rows=torch.tensor([0])))) is None
    with pytest.raises(ValueError, match="do not make one batched forward"):
        g.forward_batch([call, tree], tokens=2)  # the tree does not fit 2 tokens a session


@pytest.mark.parametrize("mode", ["ar", "specextend"])
def test_batched_engine_through_full_graphs(mode):
    """The replica's batcher over a float32 target whose decode and verification forwards go
    through full-step graphs (the twin on the CPU): sessions batched into one graphed forward emit
    what each emits alone, and the forwards were really batched."""
    from specextend.config import RetrievalConfig, SamplingParams, TreeConfig

    from helpers import make_engine
    from test_batch import run_batched

    t, d = float32_pair()
    t.decoder.graphs = FullStepGraphs(t.decoder, capture=torch.cuda.is_available())
    kw = dict(retrieval=RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2)) if mode != "ar" else {}
    engine = make_engine((t, d), mode, tree=TreeConfig(6, 3, 2), prefill_chunk=64, **kw)
    gen = torch.Generator().manual_seed(5)
    reqs = [(torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams(max_new_tokens=10, ignore_eos=True),
             {}) for n in (20, 37, 9)]
    alone = [engine.generate(p, params) for p, params, _ in reqs]
    batched_plans = lambda: [k for k in t.decoder.graphs.plans if k.sessions > 1]  # noqa: E731
    assert not batched_plans()
    got, b = run_batched(engine, reqs, max_batch=4)
    for (tokens, finish, _), (ref, ref_finish, _) in zip(got, alone):
        assert tokens == ref and finish == ref_finish
    assert batched_plans(), "no forward was batched through the graphs"


def test_warm_batches_capture_every_batched_shape_before_traffic():
    """After warmup.warm_batches (the served warm-up's last part), batched sessions of the
    adaptive ladder's trees and plain steps (and a request's 3-node trees, padded) meet no batched
    plan it did not build."""
    from specextend.config import SamplingParams, TreeConfig
    from specextend.ladder import ladder
    from specextend.warmup import warm_batches

    from helpers import make_engine
    from test_batch import run_batched

    t, d = float32_pair()
    graphs = t.decoder.graphs = FullStepGraphs(t.decoder, capture=False)
    tree = TreeConfig(8, 3, 2)
    engine = make_engine((t, d), "sd", tree=tree, prefill_chunk=64, tree_policy="adaptive", lookup_tokens=0)
    assert warm_batches(engine, 3) == 2 * (1 + len({r.nodes for r in ladder(tree)[1:]}))  # 2 and 4 sessions
    warmed = set(graphs.plans)
    assert graphs.batch_shapes == frozenset({(0, 1), (0, 5), (0, 9)})
    gen = torch.Generator().manual_seed(7)
    reqs = [(torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams(max_new_tokens=8, ignore_eos=True),
             kw) for n, kw in ((20, {}), (33, {}), (9, {"speculate": False}), (14, {"max_tree_nodes": 3}))]
    run_batched(engine, reqs, max_batch=4)
    assert graphs.batched_forwards > 0
    assert not [k for k in set(graphs.plans) - warmed if k.sessions > 1], "a batched shape was captured mid-request"


def test_a_full_cache_fails_alone():
    """A session whose cache has no room left is not batched: its CacheFull comes back as its own
    result (the batcher throws it into that session only) and the others' forwards run."""
    from specextend.kv_cache import CacheFull

    dec = decoder_on("llama3", DEVICE, torch.float32)
    dec.graphs = FullStepGraphs(dec, capture=torch.cuda.is_available())
    sessions = _sessions(dec, [10, 11, 12], seed=4)
    full = sessions[1][0]
    full.length = full.capacity
    calls = [ForwardCall(torch.tensor([2], device=DEVICE), torch.tensor([min(c.length, 40)], device=DEVICE), c, CAUSAL)
             for c, _ in sessions]
    got = forward_batch(dec, calls)
    assert isinstance(got[1], CacheFull)
    assert dec.graphs.batched_forwards == 1
    ref = sessions[0][1]
    want = dec.forward_eager(calls[0].ids, calls[0].positions, ref, CAUSAL, ForwardOptions())[0]
    torch.testing.assert_close(got[0][0], want, atol=1e-4, rtol=1e-4)
