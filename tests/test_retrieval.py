"""Cross-model retrieval: probabilities from the verify pass, chunk selection, working cache."""

import math

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
