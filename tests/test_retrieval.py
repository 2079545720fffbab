"""Cross-model retrieval: probabilities from the verify pass, chunk selection, working cache."""

import math
import threading

import pytest
import torch

from specextend.attention.backends import CAUSAL
from specextend.config import RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.base import DraftSessionParams, Retrieval
from specextend.draft.worker import DraftWorker
from specextend.draft.session import DraftSession
from specextend.models.decoder import ForwardOptions
from specextend.retrieval import (chunk_positions, chunk_scores, initial_chunks, last_token_probs,
                                  select_chunks)
from specextend.target import TargetSession
from specextend.verify import verify_tree

from helpers import make_engine

CFG = RetrievalConfig(enabled=True, chunk_size=4, top_k=5, every=1, sink_chunks=1, recent_chunks=2)


@pytest.mark.parametrize("backend", ["eager", "torch"])
@pytest.mark.parametrize("hybrid", [True, False])
def test_cmr_probabilities_equal_eager_softmax_row(tiny_models, backend, hybrid):
    """exp(q.k*scale - lse) from the tree pass == the softmax row of a fresh eager last-layer pass."""
    target, draft = tiny_models("float64", backend)
    dec = target.decoder
    prompt = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    ts = TargetSession(dec, 128, hybrid=hybrid)
    root = int(torch.argmax(ts.prefill(prompt, 16)))
    tree = DraftSession(draft.decoder, prompt, DraftSessionParams(TreeConfig(10, 4, 3))).step(0, [root], None)
    tokens, parents = tree.tokens, tree.parents
    logits = ts.verify(root, tokens, parents, capture=True)
    verdict = verify_tree(logits, tokens, parents, SamplingParams(), None, forced_length=2)
    ts.commit(verdict.accepted)
    ctx = ts.cache.length
    row = verdict.accepted[-1] + 1
    keys = ts.cache.layer(dec.args.num_layers - 1)[0][:, :ctx]
    got = last_token_probs(ts.captured.q[:, row], ts.captured.lse[:, row], keys, dec.scale)
    # reference: recompute the last accepted token from scratch and take an explicit softmax
    seq = prompt + [root] + [tokens[a] for a in verdict.accepted]
    cache = dec.new_cache(len(seq))
    dev = dec.device
    dec.forward(torch.tensor(seq[:-1], device=dev), torch.arange(len(seq) - 1, device=dev), cache, CAUSAL)
    cache.advance(len(seq) - 1)
    _, cap = dec.forward(torch.tensor(seq[-1:], device=dev), torch.tensor([len(seq) - 1], device=dev), cache,
                         CAUSAL, ForwardOptions(capture_last=True))
    k_all = cache.layer(dec.args.num_layers - 1)[0][:, :len(seq)]  # [G, S, D]
    g = k_all.shape[0]
    q = cap.q[:, 0].reshape(g, -1, dec.args.head_dim)  # [G, H/G, D]
    ref = torch.softmax(torch.einsum("grd,gsd->grs", q, k_all) * dec.scale, -1).mean((0, 1))
    assert ctx == len(seq)
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-5)
    assert math.isclose(float(got.sum()), 1.0, rel_tol=1e-5)


def test_chunk_scores_mean_with_partial_last_chunk():
    probs = torch.arange(10, dtype=torch.float32)
    torch.testing.assert_close(chunk_scores(probs, 4), torch.tensor([1.5, 5.5, 8.5]))


def test_selection_budget_sink_recent_and_document_order():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        nc = int(torch.randint(1, 40, (1,), generator=gen))
        scores = torch.rand(nc, generator=gen)
        ids = select_chunks(scores, CFG)
        assert ids == sorted(set(ids))
        if nc <= CFG.top_k:
            assert ids == list(range(nc))
            continue
        assert len(ids) == CFG.top_k
        assert 0 in ids and nc - 1 in ids and nc - 2 in ids
        others = [i for i in range(1, nc - 2)]
        chosen = [i for i in ids if i in others]
        worst_chosen = min(scores[chosen]) if chosen else float("inf")
        assert all(scores[i] <= worst_chosen for i in others if i not in ids)


def test_initial_selection_is_sink_plus_most_recent():
    assert initial_chunks(8, CFG) == [0, 1]
    assert initial_chunks(100, CFG) == [0, 21, 22, 23, 24]
    assert chunk_positions([0, 2], 4, 10).tolist() == [0, 1, 2, 3, 8, 9]


def test_working_cache_rebuilt_with_every_chunk_equals_full_cache(tiny_models):
    """Rebuilding from the pre-RoPE store with all chunks (positions unchanged) drafts the same tree."""
    _, draft = tiny_models("float64")
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    tree = TreeConfig(10, 4, 3)
    full = DraftSession(draft.decoder, prompt, DraftSessionParams(tree))
    big = RetrievalConfig(enabled=True, chunk_size=4, top_k=100)
    cmr = DraftSession(draft.decoder, prompt, DraftSessionParams(tree, big))
    a = full.step(0, [5], None)
    b = cmr.step(0, [5], Retrieval(tuple(range(8)), 4))
    assert cmr.refreshes == 1 and (a.tokens, a.parents) == (b.tokens, b.parents)


def test_retrieval_prunes_and_resets_per_request(tiny_models):
    pair = tiny_models("float64")
    cfg = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)
    eng = make_engine(pair, "specextend", tree=TreeConfig(12, 4, 3), retrieval=cfg)
    long = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    first = eng.generate(long, params)
    assert first[2].retrieval_refreshes > 0
    assert first[2].draft_cache_tokens < cfg.budget_tokens + 40  # pruned far below 200
    short_run = eng.generate(long[:10], SamplingParams(max_new_tokens=15, ignore_eos=True))
    assert short_run[2].retrieval_refreshes == 0  # context stays within the budget: no-op
    again = eng.generate(long, params)
    assert again[0] == first[0]
    assert again[2].accepted_per_step == first[2].accepted_per_step  # no state carried over
    assert eng.draft.num_sessions == 0


def test_prefill_scores_the_first_tree(tiny_models):
    """The prompt's last token's final-layer row from the chunked prefill equals a fresh softmax
    row, and step 0 already carries chunk ids selected from it."""
    target, draft = tiny_models("float64")
    dec = target.decoder
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    ts = TargetSession(dec, 128, hybrid=True)
    ts.prefill(prompt, 32, capture=True)  # three chunks: the last one is captured
    keys = ts.cache.layer(dec.args.num_layers - 1)[0][:, :70]
    got = last_token_probs(ts.captured.q[:, -1], ts.captured.lse[:, -1], keys, dec.scale)
    g = keys.shape[0]
    q = ts.captured.q[:, -1].reshape(g, -1, dec.args.head_dim)
    ref = torch.softmax(torch.einsum("grd,gsd->grs", q, keys) * dec.scale, -1).mean((0, 1))
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-5)

    seen = []

    class Recording(DraftWorker):
        def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
            seen.append((step, retrieval))
            return super().step(session_id, step, accepted_tokens, retrieval, bound)

    cfg = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=3)
    eng = make_engine((target, draft), "specextend", draft_backend=Recording(draft.decoder), tree=TreeConfig(8, 3, 2),
                      retrieval=cfg)
    eng.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert seen[0][0] == 0 and seen[0][1] is not None and len(seen[0][1].chunk_ids) == cfg.top_k
    assert all(r is None for s, r in seen[1:] if s % cfg.every)  # then every `every` steps only


@pytest.mark.parametrize("sink,recent,top_k", [(1, 2, 8), (0, 0, 5), (2, 6, 8), (4, 4, 16)])
def test_selection_on_the_device_equals_its_twin(sink, recent, top_k):
    """select_chunks_device (no wait for the device: its ids read when a call carries them) against
    select_chunks, ties included (scores drawn from a few values)."""
    from specextend.retrieval import select_chunks_device

    cfg = RetrievalConfig(top_k=top_k, sink_chunks=sink, recent_chunks=recent)
    gen = torch.Generator().manual_seed(top_k)
    for trial in range(40):
        nc = int(torch.randint(1, 60, (1,), generator=gen))
        scores = torch.randint(0, 4 if trial % 2 else 1000, (nc,), generator=gen).float()
        assert select_chunks_device(scores, cfg).tolist() == select_chunks(scores, cfg)


def test_a_deferred_selection_reaches_the_draft_as_its_ids():
    """DeferredRetrieval (the target's selection read where a call carries it) goes over the wire and
    into a draft session as the same Retrieval would."""
    from specextend.retrieval import DeferredRetrieval
    from specextend.rpc.convert import retrieval_from_proto, step_to_proto

    ids = torch.tensor([0, 3, 7, 9])
    deferred = DeferredRetrieval(ids, 4)
    assert deferred.chunk_ids == (0, 3, 7, 9) and deferred.chunk_size == 4
    ids[0] = 5  # a copy: the device tensor may be reused
    assert retrieval_from_proto(step_to_proto("s", 1, [2], deferred)) == Retrieval((0, 3, 7, 9), 4)
    assert "(0, 3, 7, 9)" in repr(deferred)


def test_a_deferred_selection_is_on_the_host_once_launched_and_copied():
    """`on_host` (draft_link.start_ask reads it: only such a selection goes with a call begun on the
    engine's thread): not before its scoring is launched; on the CPU at once after; on a GPU once
    its copy's event has passed."""
    from specextend.retrieval import DeferredRetrieval

    sel = DeferredRetrieval.later(lambda: torch.tensor([2, 5]), torch.device("cpu"), 8)
    assert not sel.on_host
    sel.launch()
    assert sel.on_host and sel.chunk_ids == (2, 5) and sel.on_host
    assert DeferredRetrieval(torch.tensor([1]), 8).on_host
    if torch.cuda.is_available():
        dev = DeferredRetrieval(torch.tensor([1, 2], device="cuda"), 8)
        torch.cuda.synchronize()
        assert dev.on_host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_deferred_selection_equals_its_twin():
    """On the device: select_chunks_device's ids, read through DeferredRetrieval (pinned copy, event),
    equal select_chunks' on the same scores, ties included."""
    from specextend.retrieval import DeferredRetrieval, select_chunks_device

    cfg = RetrievalConfig(top_k=32, sink_chunks=1, recent_chunks=4)
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        scores = torch.randint(0, 3 if trial % 2 else 10**6, (520,), generator=gen).float().cuda()
        deferred = DeferredRetrieval(select_chunks_device(scores, cfg), 32)
        assert list(deferred.chunk_ids) == select_chunks(scores, cfg)


def test_a_lazy_selection_is_scored_when_launched_and_equals_its_twin(tiny_models):
    """TargetSession.selection(lazy=True) queues nothing: it holds the query row, its LSE and a view of
    the keys, and scores them when launched (or read). Scored after later forwards and commits (the
    engine launches it in the next forward's shadow), it equals the eager selection made at once."""
    from specextend.retrieval import DeferredRetrieval, launch_scoring

    target, draft = tiny_models("float64")
    dec = target.decoder
    prompt = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    ts = TargetSession(dec, 160, hybrid=True)
    root = int(torch.argmax(ts.prefill(prompt, 32)))
    session = DraftSession(draft.decoder, prompt, DraftSessionParams(TreeConfig(10, 4, 3)))
    tree = session.step(0, [root], None)
    logits = ts.verify(root, tree.tokens, tree.parents, capture=True)
    verdict = verify_tree(logits, tree.tokens, tree.parents, SamplingParams(), None, forced_length=2)
    ts.commit(verdict.accepted)
    row = verdict.accepted[-1] + 1
    eager = ts.selection(row, CFG, lazy=False)
    lazy = ts.selection(row, CFG, lazy=True)
    assert isinstance(lazy, DeferredRetrieval) and not lazy.launched
    assert isinstance(eager, Retrieval) and len(eager.chunk_ids) == CFG.top_k
    # later steps: another verification (with a capture of its own) and its commit
    nxt = verdict.tokens[-1]
    tree2 = session.step(1, verdict.tokens, None)
    logits2 = ts.verify(nxt, tree2.tokens, tree2.parents, capture=True)
    ts.commit(verify_tree(logits2, tree2.tokens, tree2.parents, SamplingParams(), None).accepted)
    launch_scoring(lazy)
    assert lazy.launched
    launch_scoring(lazy)  # once only
    assert lazy.chunk_ids == eager.chunk_ids and lazy.chunk_size == CFG.chunk_size
    # read before any launch: scored there
    late = ts.selection(-1, CFG, lazy=True)  # (the capture's last row)
    assert not late.launched and len(late.chunk_ids) == CFG.top_k and late.launched
    launch_scoring(None)
    launch_scoring(eager)  # (anything but a lazy selection: as it is)


def test_a_lazy_selection_is_scored_once_whichever_threads_launch_it():
    from concurrent.futures import ThreadPoolExecutor

    from specextend.retrieval import DeferredRetrieval

    calls = []

    def score():
        calls.append(1)
        return torch.tensor([1, 4, 6])
    sel = DeferredRetrieval.later(score, torch.device("cpu"), 8)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: sel.chunk_ids, range(16)))
    assert calls == [1] and got == [(1, 4, 6)] * 16


def test_the_engine_scores_a_selection_in_the_next_forwards_shadow(monkeypatch):
    """With lazy selections (a GPU's default, forced here) and an overlapping draft that is told plain
    steps and asked early, refreshes travel with calls made after a forward: the engine launches
    their scoring once that forward is queued, before the call reads them, and every other selection
    before it hands it to a call: no call's thread queues kernels (a graph capture on the engine's
    thread forbids other threads' work). Output unchanged."""
    import specextend.engine_steps as engine_mod
    import specextend.plain_step as plain_step_mod
    from specextend.retrieval import DeferredRetrieval

    from test_told import Runs, recorded_run

    made, by_engine = [], []
    selection = TargetSession.selection

    def lazy_selection(self, row, c, lazy=None):
        out = selection(self, row, c, lazy=True)
        made.append(out)
        return out

    def launch(retrieval):
        if isinstance(retrieval, DeferredRetrieval) and not retrieval.launched:
            by_engine.append(retrieval)
            retrieval.launch()
    threads = []
    launch_once = DeferredRetrieval.launch

    def recording_launch(self):
        if not self.launched:  # (where the kernels are queued)
            threads.append(threading.current_thread())
        launch_once(self)
    monkeypatch.setattr(TargetSession, "selection", lazy_selection)
    monkeypatch.setattr(engine_mod, "launch_scoring", launch)
    monkeypatch.setattr(plain_step_mod, "launch_scoring", launch)
    monkeypatch.setattr(DeferredRetrieval, "launch", recording_launch)
    # on the CPU whatever the machine (an in-process draft on the target's GPU would capture graphs
    # on its own thread beside the engine's; the stream handling has its GPU test below)
    from specextend.models.loader import load_model

    t = load_model("random:llama-tiny", dtype="float64", attention_backend="torch", device="cpu")
    d = load_model("random:llama-tiny-draft", role="draft", dtype="float64", attention_backend="torch", device="cpu",
                   vocab_size=t.args.vocab_size, target_weights=t.decoder.w)
    pair = (t, d)
    retrieval = RetrievalConfig(chunk_size=4, top_k=6, every=1)
    ref, out, stats, _ = recorded_run(pair, Runs, SamplingParams(40, ignore_eos=True), 0.0, retrieval=retrieval)
    assert out == ref and stats.retrieval_refreshes >= 1  # (how many trees verify, and so refresh, is timing's)
    lazies = [m for m in made if isinstance(m, DeferredRetrieval)]
    assert len(lazies) == stats.retrieval_refreshes and by_engine  # (the prefill's, at least, went with a call)
    assert all(s.launched for s in by_engine)
    assert threads and all(t is threading.main_thread() for t in threads)  # never a call's thread


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_lazy_selection_launched_on_another_thread_runs_on_its_makers_stream():
    """DeferredRetrieval.later on the device: launched from another thread (a draft call's), its
    kernels go on the stream current where it was made, after the work queued there before it."""
    import threading

    from specextend.retrieval import DeferredRetrieval, select_chunks_device

    cfg = RetrievalConfig(top_k=32, sink_chunks=1, recent_chunks=4)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        scores = torch.zeros(520, device="cuda")
        torch.cuda._sleep(50_000_000)  # the maker's stream is busy when the scores are written
        scores.copy_(torch.arange(520, device="cuda").float().flip(0))
        sel = DeferredRetrieval.later(lambda: select_chunks_device(scores, cfg), torch.device("cuda"), 32)
    got = []
    t = threading.Thread(target=lambda: got.append(sel.chunk_ids))
    t.start()
    t.join()
    assert list(got[0]) == select_chunks(torch.arange(520).float().flip(0), cfg)
