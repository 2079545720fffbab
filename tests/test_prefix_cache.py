"""Prefix caching (prefix_cache.py, docs/architecture.md, "Prefix caching"): whole prefill chunks of
recent prompts reused by a later prompt that starts with them; the output is the one without the
cache, token for token, in every mode."""

from __future__ import annotations

import pytest
import torch

from specextend import prefix_cache as pc
from specextend.config import RetrievalConfig, SamplingParams, TreeConfig
from specextend.kv_cache import KVCache
from specextend.prefix_cache import PrefixCache

from helpers import make_engine

CHUNK = 4


def filled(tokens, capacity=64):
    """A cache whose K/V at position i are all float(tokens[i]) (what a prefill of them left)."""
    cache = KVCache(2, 1, 3, capacity, torch.float32)
    n = len(tokens)
    cache.data[:, :, :, :n] = torch.tensor(tokens, dtype=torch.float32).view(1, 1, 1, n, 1)
    cache.advance(n)
    return cache


def per_token_bytes():
    return 2 * 2 * 1 * 3 * 4  # layers, k/v, G, D, float32


def test_a_hit_is_the_longest_run_of_whole_chunks_that_leaves_the_last_token():
    cache = PrefixCache(CHUNK, 1 << 20)
    doc = list(range(10, 21))  # 11 tokens: two whole chunks kept
    assert cache.store(doc, filled(doc)) and cache.nbytes == 8 * per_token_bytes()
    m, kv = cache.lookup(doc + [99, 98])
    assert m == 8 and torch.equal(kv, filled(doc).data[:, :, :, :8])
    assert cache.lookup(doc[:8])[0] == 4  # the prompt's last token is forwarded: chunk 2 is recomputed
    assert cache.lookup(doc[:7])[0] == 4 and cache.lookup(doc[:4])[0] == 0
    assert cache.lookup(doc[:5] + [0] * 6)[0] == 4  # diverges inside chunk 2
    assert cache.lookup([0] + doc)[0] == 0
    assert (cache.queries, cache.hits) == (13 + 8 + 7 + 4 + 11 + 12, 8 + 4 + 4 + 4)


def test_a_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(pc, "boundary_hashes", lambda tokens, chunk, upto: [7] * (upto // chunk))
    cache = PrefixCache(CHUNK, 1 << 20)
    doc = list(range(12))
    cache.store(doc, filled(doc))
    assert cache.lookup([1] * 12)[0] == 0  # every boundary "matches" by hash; the tokens do not
    assert cache.lookup(doc + [5])[0] == 12


def test_least_recently_used_entries_go_first_within_the_budget():
    cache = PrefixCache(CHUNK, 16 * per_token_bytes())  # room for two entries of 8 tokens
    a, b, c = ([k] * 8 for k in (1, 2, 3))
    assert cache.store(a, filled(a)) and cache.store(b, filled(b))
    assert cache.lookup(a + [0])[0] == 8  # a is now the most recently used
    assert cache.store(c, filled(c))
    assert cache.lookup(b + [0])[0] == 0 and cache.lookup(a + [0])[0] == 8 and cache.lookup(c + [0])[0] == 8
    assert len(cache) == 2 and cache.nbytes == 16 * per_token_bytes()
    big = list(range(20))
    assert not cache.store(big, filled(big)) and len(cache) == 2  # larger than the budget: not kept
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.lookup(a + [0])[0] == 0


def test_an_entry_that_extends_another_replaces_it_and_a_held_prefix_is_not_kept_twice():
    cache = PrefixCache(CHUNK, 1 << 20)
    doc = list(range(16))
    assert cache.store(doc[:8], filled(doc[:8]))
    assert cache.store(doc, filled(doc)) and len(cache) == 1 and cache.nbytes == 16 * per_token_bytes()
    assert not cache.store(doc[:12], filled(doc[:12])) and len(cache) == 1  # held (by the longer one)
    assert cache.lookup(doc[:9])[0] == 8 and cache.lookup(doc + [1])[0] == 16
    other = doc[:8] + [50] * 8  # shares two chunks, then diverges: both kept
    assert cache.store(other, filled(other)) and len(cache) == 2
    m, kv = cache.lookup(other + [1])
    assert m == 16 and torch.equal(kv, filled(other).data[:, :, :, :16])
    cache._drop(next(iter(cache._entries)))  # the index forgets only what the dropped entry held
    assert cache.lookup(doc[:9])[0] == 8 and cache.lookup(doc + [1])[0] == 8


# ------------------------------------------------------------------ the engine

DOC = [(13 * i + 5) % 250 for i in range(70)]


@pytest.mark.parametrize("mode,dtype,sampling", [("ar", "float32", False), ("sd", "float64", False),
                                                  ("specextend", "float32", False), ("specextend", "float64", True)])
def test_questions_over_one_document_decode_as_without_the_cache(tiny_models, mode, dtype, sampling):
    """Exact in float32 too: the cached chunks are the forwards a prefill of the new prompt runs."""
    pair = tiny_models(dtype)
    kw = dict(prefill_chunk=16, tree=TreeConfig(8, 4, 2), lookup_tokens=0,
              retrieval=RetrievalConfig(chunk_size=8, top_k=4, every=2))
    params = SamplingParams(24, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=3)
    cached, plain = make_engine(pair, mode, **kw), make_engine(pair, mode, prefix_cache_gb=0, **kw)
    assert plain.prefix_cache is None
    hits = []
    long = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17, 18]
    for question in ([1, 2, 3], long, long + [19, 20]):
        out, _, stats = cached.generate(DOC + question, params)
        ref, _, _ = plain.generate(DOC + question, params)
        assert out == ref
        hits.append(stats.cached_prompt_tokens)
    assert hits == [0, 64, 80]  # 4 chunks of the document; then 5: the second prompt's, kept


def test_warm_up_leaves_the_prefix_cache_empty(tiny_models):
    from specextend.warmup import warm_up

    engine = make_engine(tiny_models("float64"), "sd", prefill_chunk=16)
    warm_up(engine, DOC)
    assert len(engine.prefix_cache) == 0


@pytest.mark.parametrize("retrieval", [False, True])
def test_the_drafts_prefill_reuses_its_cache_and_drafts_the_same_trees(tiny_models, retrieval):
    """The draft's sessions prefill from its own prefix cache (both its caches: the working one and,
    with retrieval, the pre-RoPE store): the same trees as without it, step for step."""
    from specextend.draft.worker import DraftWorker

    pair = tiny_models("float64")
    kw = dict(prefill_chunk=16, tree=TreeConfig(8, 4, 2), lookup_tokens=0,
              retrieval=RetrievalConfig(enabled=retrieval, chunk_size=8, top_k=4, every=2))
    params = SamplingParams(20, ignore_eos=True)
    workers = [DraftWorker(pair[1].decoder, prefill_chunk=16, prefix_cache=PrefixCache(16, 1 << 30)),
               DraftWorker(pair[1].decoder, prefill_chunk=16)]
    engines = [make_engine(pair, "sd", draft_backend=w, prefix_cache_gb=0, **kw) for w in workers]
    for question in ([1, 2, 3], [4, 5, 6, 7]):
        runs = [e.generate(DOC + question, params) for e in engines]
        assert runs[0][0] == runs[1][0]
        assert runs[0][2].accepted_per_step == runs[1][2].accepted_per_step  # the same trees' verdicts
        assert runs[0][2].num_steps > 0
    assert workers[0].prefix_cache.hits == 64 and len(workers[0].prefix_cache) == 1
    for w in workers:
        w.shutdown()


# ------------------------------------------------------------------ prompts that arrive together

def test_a_promised_prefill_is_waited_for_then_found():
    cache = PrefixCache(CHUNK, 1 << 20)
    doc = list(range(10, 22))  # 12 tokens: three whole chunks
    held = doc[:4]
    cache.store(held, filled(held))
    p = cache.promise(doc, 4)  # a prefill from the cached chunk on will store chunks 2 and 3
    assert p.hashes and cache.promise(doc, 12) is None  # (nothing past 12 to promise)
    assert cache.awaited(doc + [1]) is p.done and cache.awaited(doc[:9] + [0, 0, 0]) is p.done
    assert cache.awaited(doc[:5]) is None  # what it can use (one chunk) is held already
    assert cache.awaited([0] + doc) is None
    cache.store(doc, filled(doc))
    cache.fulfil(p)
    assert p.done.done() and cache.awaited(doc + [1]) is None and cache.lookup(doc + [1])[0] == 12
    failed = cache.promise([5] * 8, 0)
    cache.fulfil(failed)  # a prefill that ended without storing: the waiters look up, and miss
    assert failed.done.done() and cache.awaited([5] * 9) is None and cache.lookup([5] * 9)[0] == 0
    long = list(range(100, 124))  # six chunks promised: a prompt sharing three waits, one sharing one does not
    p = cache.promise(long, 0)
    assert cache.awaited(long[:4] + [0] * 8) is None and cache.awaited(long[:12] + [0]) is p.done


QUESTIONS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


def test_prompts_arriving_together_prefill_their_shared_chunks_once(tiny_models):
    """Batched sessions over one document: one prefills it, the others wait for its chunks and
    prefill only their own tails; every output equals its solo run without the cache."""
    from specextend.models.batch import forward_batch

    from test_batch import run_batched

    pair = tiny_models("float64")
    kw = dict(prefill_chunk=16, tree=TreeConfig(8, 4, 2), lookup_tokens=0,
              retrieval=RetrievalConfig(chunk_size=8, top_k=4, every=2))
    params = SamplingParams(16, ignore_eos=True)
    alone = [make_engine(pair, "specextend", prefix_cache_gb=0, **kw).generate(DOC + q, params)[0] for q in QUESTIONS]
    rows = []

    def recording(model, calls):
        rows.extend(c.ids.shape[0] for c in calls if c.prompt)
        return forward_batch(model, calls)

    engine = make_engine(pair, "specextend", **kw)
    got, _ = run_batched(engine, [(DOC + q, params, {}) for q in QUESTIONS], forward=recording)
    assert [g[0] for g in got] == alone
    assert sorted(g[2].cached_prompt_tokens for g in got) == [0, 64, 64, 64]
    assert sum(rows) == sum(len(DOC) + len(q) for q in QUESTIONS) - 3 * 64  # the document's 4 chunks once


def test_a_waited_for_prefill_that_ends_early_leaves_the_waiter_to_prefill_itself(tiny_models):
    from specextend.session_calls import DraftCall, drive_alone

    pair = tiny_models("float64")
    params = SamplingParams(12, ignore_eos=True)
    alone = make_engine(pair, "ar", prefix_cache_gb=0, prefill_chunk=16).generate(DOC + [1], params)[0]
    engine = make_engine(pair, "ar", prefill_chunk=16)
    with torch.inference_mode():  # (as the drivers run sessions)
        leader, waiter = engine.session(DOC + [2], params), engine.session(DOC + [1], params)
        assert next(leader).prompt  # its first chunk's forward: it promised the document's chunks
        wait = next(waiter)
        assert isinstance(wait, DraftCall) and not wait.future.done()
        leader.close()  # (a client gone mid-prefill)
        assert wait.future.done()
        out = [t for ev in drive_alone(waiter, engine.target.decoder) for t in ev.token_ids]
    assert out == alone
    assert len(engine.prefix_cache) == 1  # the waiter's prompt, kept
