"""Context lookup in the engine (docs/architecture.md, "Context lookup"): chains grafted onto the
draft's trees and verified on steps without one leave the output the target's alone (float64: equal
to `ar`, greedy and seeded sampling), and are really used.

A tiny random target does not repeat its context, so the real index (tests/test_lookup.py) would
rarely find a chain here: these tests replace it with an oracle that proposes what the target will
emit next, wrong from a seeded random point on, so that chains are accepted, partly accepted and
rejected at every depth."""

from __future__ import annotations

import random

import pytest

import specextend.engine

from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine

from helpers import make_engine
from test_unready import NeverReady

RETRIEVAL = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)


def prompt(n=60):
    return [(11 * i + 5) % 251 for i in range(n)]


class Oracle:
    """ContextIndex's interface; continuation = the reference output from the current position, its
    tokens replaced from a random position on (sometimes none)."""

    ref: list = []
    prompt_len = 0

    def __init__(self, ids, vocab_size, ns=(3, 2), capacity=0):
        self.length, self.vocab, self.ns = len(ids), vocab_size, ns  # (ns: RequestLookup.could_pay's orders)
        self.rng = random.Random(self.length)

    def extend(self, tokens):
        self.length += len(tokens)

    def match(self, max_tokens):
        return 3, self.continuation(max_tokens)  # as if found through a 3-gram

    def continuation(self, max_tokens):
        pos = self.length - Oracle.prompt_len
        chain = list(Oracle.ref[pos:pos + max_tokens])
        for i in range(self.rng.randrange(0, 2 * max_tokens + 1), len(chain)):  # wrong from here on
            chain[i] = (chain[i] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return chain


@pytest.fixture
def oracle(monkeypatch, ar_engine):
    """Sets the reference the oracle copies from: oracle(prompt, params) -> the `ar` output."""
    monkeypatch.setattr(specextend.engine, "ContextIndex", Oracle)

    def use(p, params):
        free = SamplingParams(max_new_tokens=params.max_new_tokens + 40, temperature=params.temperature,
                              top_p=params.top_p, seed=params.seed, ignore_eos=True)
        Oracle.ref, Oracle.prompt_len = ar_engine.generate(p, free)[0], len(p)
        return ar_engine.generate(p, params)[0]
    return use


@pytest.mark.parametrize("lookup", [3, 8])
@pytest.mark.parametrize("kw", [dict(mode="sd"), dict(mode="specextend", retrieval=RETRIEVAL),
                                dict(mode="sd", tree_policy="adaptive")], ids=["sd", "specextend", "adaptive"])
@pytest.mark.parametrize("tree", [TreeConfig(1, 1, 1), TreeConfig(12, 4, 3)], ids=["n1", "n12"])
def test_greedy_with_lookup_equals_autoregressive(pair, oracle, lookup, kw, tree):
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ref = oracle(prompt(), params)
    out, finish, stats = make_engine(pair, tree=tree, lookup_tokens=lookup, **kw).generate(prompt(), params)
    assert out == ref and finish == "length"
    assert stats.lookup_nodes > 0 and stats.lookup_accepted > 0  # the chains were verified and paid
    assert stats.lookup_accepted <= stats.lookup_nodes


def test_sampling_with_lookup_same_seed_same_output(pair, oracle):
    """One uniform draw per emitted token, in order, whichever node proposed it."""
    used = 0
    for seed in range(4):
        params = SamplingParams(max_new_tokens=40, temperature=0.7, top_p=0.95, seed=seed, ignore_eos=True)
        ref = oracle(prompt(), params)
        out, _, stats = make_engine(pair, tree=TreeConfig(8, 3, 2), lookup_tokens=6).generate(prompt(), params)
        assert out == ref
        used += stats.lookup_accepted
    assert used > 0


def test_steps_without_a_tree_verify_the_chain(pair, oracle):
    """A draft that never has a tree ready (overlap, unready steps plain): those steps verify the
    lookup chain instead of decoding one token, and every accepted token reaches the draft once."""
    target, _ = pair
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = oracle(prompt(), params)
    draft = NeverReady()
    cfg = EngineConfig(mode="sd", tree=TreeConfig(8, 4, 3), tree_policy="fixed", lookup_tokens=8)
    out, _, stats = Engine(cfg, target, draft).generate(prompt(), params)
    assert out == ref and stats.num_steps == 0
    assert stats.lookup_steps > 0 and stats.lookup_accepted > 0
    assert stats.unready_steps < len(out) - 1  # fewer target forwards than tokens
    sent = [t for _, toks in draft.steps for t in toks]
    assert sent == out[:len(sent)]  # in order, none twice


def test_lookup_with_an_overlapping_draft(pair, oracle):
    target, draft = pair
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = oracle(prompt(70), params)
    worker = DraftWorker(draft.decoder, overlap=True)
    try:
        cfg = EngineConfig(mode="specextend", tree=TreeConfig(8, 4, 3), retrieval=RETRIEVAL, tree_policy="fixed",
                           draft_overlap=True, draft_snapshots="off", lookup_tokens=8)
        out, _, stats = Engine(cfg, target, worker).generate(prompt(70), params)
    finally:
        worker.shutdown()
    assert out == ref and stats.lookup_accepted > 0


@pytest.mark.parametrize("max_new", [1, 5, 17])
def test_a_stop_inside_an_accepted_chain_cuts_where_autoregressive_stops(pair, ar_engine, oracle, max_new):
    free = oracle(prompt(), SamplingParams(max_new_tokens=40, ignore_eos=True))
    for stop in (free[2], free[9]):
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, stop_token_ids=(stop,))
        ref = ar_engine.generate(prompt(), params)[:2]
        out = make_engine(pair, tree=TreeConfig(4, 2, 2), lookup_tokens=8).generate(prompt(), params)[:2]
        assert out == ref


def test_plain_decoding_never_looks_up(pair, ar_engine):
    target, _ = pair
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    out, _, stats = Engine(EngineConfig(mode="ar", lookup_tokens=8), target).generate(prompt(), params)
    assert out == ar_engine.generate(prompt(), params)[0]
    assert stats.lookup_steps == stats.lookup_nodes == 0
    cfg = EngineConfig(mode="sd", tree=TreeConfig(4, 2, 2), lookup_tokens=8, tree_policy="fixed")
    _, _, stats = make_engine(pair, **{k: getattr(cfg, k) for k in ("mode", "tree", "lookup_tokens")}).generate(
        prompt(), params, speculate=False)  # a request that turned speculation off
    assert stats.lookup_steps == stats.lookup_nodes == 0


# ------------------------------------------------------------------ mode lookup: no draft model
@pytest.mark.parametrize("lookup", [2, 8])
@pytest.mark.parametrize("sampling", [False, True])
def test_mode_lookup_alone_equals_autoregressive_and_uses_its_chains(pair, oracle, lookup, sampling):
    """mode=lookup: no draft backend; every step decodes one token or verifies the context's chain
    (HTA); the output is the target's alone, greedy or seeded sampling."""
    target, _ = pair
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.7 if sampling else 0.0, seed=5)
    ref = oracle(prompt(), params)
    engine = Engine(EngineConfig(mode="lookup", lookup_tokens=lookup), target)
    assert engine.draft is None and engine.config.hybrid_attention and not engine.config.uses_draft
    out, _, stats = engine.generate(prompt(), params)
    assert out == ref
    assert stats.lookup_steps > 0 and stats.lookup_accepted > 0 and stats.num_steps == 0
    off = engine.generate(prompt(), params, speculate=False)[2]  # a request that turned speculation off
    assert off.lookup_steps == 0


def test_mode_lookup_needs_chains():
    with pytest.raises(ValueError, match="lookup_tokens"):
        EngineConfig(mode="lookup", lookup_tokens=0)


def test_the_gate_learnt_by_one_request_starts_the_next(pair, ar_engine, monkeypatch):
    """The lookup gate's rates carry over to the engine's next request (as the costs do): the next
    request's gate starts from a copy of what the last one learnt (its chains' hit rates and the
    host costs), not from the prior; with carry_costs off, from the prior. Outputs equal `ar`'s.
    (What it saves is timing-dependent: the gate weighs measured costs; benchmarks/regimes.py.)"""
    target, _ = pair
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    looping = [5, 9, 13, 7] * 30  # every n-gram repeats: a chain at every step, to skip or verify
    ref = ar_engine.generate(looping, params)[0]
    made = []  # (the gate, its rates when the request began)
    real = specextend.engine.RequestLookup

    def spy(*a, **kw):
        lookup = real(*a, **kw)
        made.append((lookup.gate, dict(lookup.gate.hit), dict(lookup.gate.host)))
        return lookup

    monkeypatch.setattr(specextend.engine, "RequestLookup", spy)
    for carry in (True, False):
        made.clear()
        engine = Engine(EngineConfig(mode="lookup", lookup_tokens=8), target)
        engine.carry_costs = carry
        assert [engine.generate(looping, params)[0] for _ in range(2)] == [ref, ref]
        (first, hit0, _), (second, hit1, host1) = made
        assert hit0 == {} and first.hit and first.host[False] is not None  # the prior, then learnt
        assert second is not first
        if carry:
            assert hit1 == first.hit and host1 == first.host
        else:
            assert hit1 == {} and host1 == {True: None, False: None}


def test_the_request_s_own_index_finds_its_first_token_in_the_prompt(pair):
    """Without the oracle: the reference output (verify.Reference, emitted where the target's choice
    differs) copies the prompt from its 11th token on, so the context's text repeats. The request's
    index, built from the prompt while the prefill runs and extended with the first token, finds the
    chain after that token at once: the first decode step verifies 8 chain tokens and emits them with
    the bonus token, and every later step does the same."""
    target, _ = pair
    rng = random.Random(3)
    p = rng.sample(range(200), 80)  # distinct tokens: every n-gram occurs once
    params = SamplingParams(max_new_tokens=28, ignore_eos=True)
    engine = Engine(EngineConfig(mode="lookup", lookup_tokens=8), target)
    events = list(engine.stream(p, params, reference=p[10:38]))
    emitted = [e.token_ids for e in events]
    assert sum(emitted, []) == p[10:38]
    assert [len(e) for e in emitted if e] == [1, 9, 9, 9]  # the first token, then three chains of 8 + bonus
