"""Lookup runs ahead of the host (specextend/lookup_ahead.py, docs/architecture.md, "Lookup runs
ahead"): the device's chain equals the host index's, its greedy verdict equals verify_tree's, the
forward at a length held on the device equals the forward at the host's, and runs leave the output
plain decoding's (float64, exact) while their chains are really accepted."""

from __future__ import annotations

import random

import pytest
import torch

import specextend.lookup_ahead as ahead
from specextend.attention.backends import CAUSAL
from specextend.config import SamplingParams, TreeConfig
from specextend.lookup import ContextIndex
from specextend.lookup_ahead import DeviceHistory
from specextend.lookup_device import accepted, device_match
from specextend.models.batch import forward_at
from specextend.models.decoder import ForwardOptions
from specextend.models.full_graphs import FullStepGraphs
from specextend.verify import verify_tree

from helpers import make_engine, slow_target
from test_graphs import decoder_on
from test_lookup_engine import prompt


@pytest.mark.parametrize("vocab", [3, 7, 40])
@pytest.mark.parametrize("q", [1, 4, 8])
def test_device_match_equals_the_host_index(vocab, q):
    rng = random.Random(vocab * 100 + q)
    for trial in range(60):
        n = rng.randrange(1, 50)
        ids = [rng.randrange(vocab) for _ in range(n)]
        hist = torch.tensor(ids + [rng.randrange(vocab) for _ in range(20)])  # junk past the length
        chain, count = device_match(hist, torch.tensor([n]), q)
        order, want = ContextIndex(ids, vocab).match(q)
        assert int(count) == len(want), (ids, want)
        assert chain[:int(count)].tolist() == want


def test_the_verdict_equals_verify_tree_on_a_path():
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(max_new_tokens=8)
    for trial in range(200):
        q, v = 6, 9
        logits = torch.randn(q + 1, v, generator=g, dtype=torch.float64)
        y = logits.argmax(-1)
        chain = y[:q].clone()
        bad = int(torch.randint(0, q + 1, (1,), generator=g))  # wrong from here on (q: none wrong)
        if bad < q:
            chain[bad] = (chain[bad] + 1) % v
        count = int(torch.randint(0, q + 1, (1,), generator=g))
        got_y = logits.argmax(-1)
        n = accepted(got_y, chain, torch.tensor([count]))
        verdict = verify_tree(logits[:count + 1], chain[:count].tolist(), list(range(-1, count - 1)), greedy, None)
        assert got_y[:int(n) + 1].tolist() == verdict.tokens
        assert int(n) == min(bad, count)


@pytest.mark.parametrize("q", [1, 4, 8])
def test_triton_step_kernels_equal_their_twins(q):
    """DeviceHistory's fast step (three Triton kernels, in the interpreter on the CPU) against its
    torch twin: the step's input ids and chain count, then the verdict, the history and its length."""
    rng = random.Random(q)
    g = torch.Generator().manual_seed(q)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (Triton compiles for a GPU where there is one)
    for trial in range(20):
        n, vocab = rng.randrange(1, 60), rng.choice([3, 7, 40])
        ids = torch.tensor([rng.randrange(vocab) for _ in range(n)], device=dev)
        hs = [DeviceHistory(n + 8, q, dev, fast=f) for f in (False, True)]
        for h in hs:
            h.hist[:n] = ids
            h.length.fill_(n)
            h.match()
        assert torch.equal(hs[0].ids, hs[1].ids) and torch.equal(hs[0].count, hs[1].count), ids.tolist()
        logits = torch.randn(q + 1, vocab, generator=g)
        keep = rng.randrange(0, q + 1)  # the target agrees with the chain's first `keep` tokens
        for i, t in enumerate(hs[0].ids[1:].tolist()):
            logits[i, t] = 10.0 if i < keep else -10.0  # ... and not with the next
        logits = logits.to(dev)
        packed = [h.verdict(logits).clone() for h in hs]
        assert torch.equal(packed[0], packed[1])
        assert torch.equal(hs[0].length, hs[1].length) and torch.equal(hs[0].hist, hs[1].hist)
        assert int(packed[0][0]) == min(keep, int(hs[0].count))


def test_forward_at_a_device_length_equals_the_forward_at_the_host_length():
    """FullStepGraphs.forward_at (its twin op by op; the prefix kernel in Triton's interpreter on the
    CPU, compiled where there is a GPU) against Decoder.forward_eager at the same length: logits and
    the new K/V in their slots."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (Triton runs CPU tensors only interpreted)
    dec = decoder_on("llama3", dev, torch.float32)
    graphs = FullStepGraphs(dec, capture=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, dec.args.vocab_size, (30,), generator=g).to(dev)
    a, b = dec.new_cache(64), dec.new_cache(64)
    for c in (a, b):
        dec.forward_eager(ids[:20], torch.arange(20, device=dev), c, CAUSAL, ForwardOptions())
        c.advance(20)
    path = ids[20:25]
    b.length = 7  # stale: forward_at never reads it
    got = graphs.forward_at(path, torch.tensor([20], device=dev), b)
    want, _ = dec.forward_eager(path, torch.arange(20, 25, device=dev), a, CAUSAL, ForwardOptions())
    tol = 1e-5 if dev == "cpu" else 1e-4  # (a GPU's own reduction orders)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(b.data[:, :, :, :25], a.data[:, :, :, :25], atol=tol / 10, rtol=tol / 10)
    assert b.length == 7


def test_forward_at_twin_reads_the_length():
    dec = decoder_on("llama3", "cpu", torch.float64)
    cache = dec.new_cache(32)
    dec.forward_eager(torch.arange(1, 11), torch.arange(10), cache, CAUSAL, ForwardOptions())
    cache.advance(10)
    ref = dec.new_cache(32)
    dec.forward_eager(torch.arange(1, 11), torch.arange(10), ref, CAUSAL, ForwardOptions())
    ref.length = 8
    want, _ = dec.forward_eager(torch.tensor([3, 4]), torch.arange(8, 10), ref, CAUSAL, ForwardOptions())
    got = forward_at(dec, torch.tensor([3, 4]), torch.tensor([8]), cache)
    torch.testing.assert_close(got, want)
    assert cache.length == 8


class DeviceOracle:
    """device_match's stand-in: what the target emits next (its `ar` output), wrong from a seeded
    random point on, so that runs' chains are accepted whole, in part and not at all."""

    def __init__(self, ref, prompt_len, seed=0):
        self.ref, self.prompt_len, self.rng = ref, prompt_len, random.Random(seed)
        self.calls = 0

    def __call__(self, hist, length, q, ns=None):
        self.calls += 1
        pos = int(length) - self.prompt_len  # (a read back: a test's cost)
        chain = list(self.ref[pos:pos + q]) + [0] * q
        for i in range(self.rng.randrange(0, 2 * q + 1), q):
            chain[i] = (chain[i] + 1) % 251
        count = self.rng.choice([0, q, q, min(q, 2)])
        return torch.tensor(chain[:q], device=hist.device), torch.tensor([count], device=hist.device)


def _oracle_matches(monkeypatch, oracle) -> None:
    """`oracle` stands in for the device's match: the history's twin path asks it (on a GPU host the
    float64 pair runs on CUDA, where the history's kernels, which would not ask it, are the default)."""
    monkeypatch.setattr(ahead, "device_match", oracle)
    monkeypatch.setattr(ahead, "triton_available", lambda: False)


@pytest.fixture
def device_oracle(monkeypatch, ar_engine):
    def use(p, params, seed=0):
        free = SamplingParams(max_new_tokens=params.max_new_tokens + 40, ignore_eos=True)
        oracle = DeviceOracle(ar_engine.generate(p, free)[0], len(p), seed)
        _oracle_matches(monkeypatch, oracle)
        return ar_engine.generate(p, params)[0], oracle
    return use


@pytest.mark.parametrize("kw", [dict(mode="lookup"), dict(mode="sd", tree_policy="adaptive")], ids=["lookup", "adaptive"])
@pytest.mark.parametrize("new", [3, 48])
def test_runs_ahead_are_lossless_and_accept_chains(pair, device_oracle, kw, new):
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    total_accepted = 0
    for seed in range(3):
        ref, oracle = device_oracle(prompt(), params, seed)
        engine = make_engine(pair, tree=TreeConfig(8, 3, 2), lookup_tokens=6, **kw)
        engine.lookup_ahead = True
        out, finish, stats = engine.generate(prompt(), params)
        assert out == ref and finish == "length"
        if kw["mode"] == "lookup":
            assert oracle.calls > 0  # (the adaptive policy may take trees throughout a short request)
            assert 0 < stats.ahead_steps < len(out)  # (the first token: the prefill's)
        total_accepted += stats.lookup_accepted
    if new > 3 and kw["mode"] == "lookup":
        assert total_accepted > 0


def test_a_stop_token_inside_a_run_ends_the_request_there(pair, device_oracle):
    free = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref, oracle = device_oracle(prompt(), free)
    stop = ref[17]
    params = SamplingParams(max_new_tokens=40, stop_token_ids=[stop])
    engine = make_engine(pair, mode="lookup", lookup_tokens=6)
    engine.lookup_ahead = True
    out, finish, _ = engine.generate(prompt(), params)
    assert finish == "stop" and out == ref[:ref.index(stop) + 1]


@pytest.mark.parametrize("kw", [dict(mode="lookup"), dict(mode="sd", tree_policy="adaptive")], ids=["lookup", "adaptive"])
def test_sampled_runs_emit_the_seeded_plain_tokens(pair, monkeypatch, ar_engine, kw):
    """A sampled request's runs draw one uniform per position from its generator, in order: with the
    same seed they emit exactly what plain decoding samples (float64), chains accepted on the way."""
    total = 0
    for seed in range(3):
        params = SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
        longer = SamplingParams(max_new_tokens=80, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
        oracle = DeviceOracle(ar_engine.generate(prompt(), longer)[0], len(prompt()), seed)
        _oracle_matches(monkeypatch, oracle)
        want = ar_engine.generate(prompt(), params)[0]
        engine = make_engine(pair, tree=TreeConfig(8, 3, 2), lookup_tokens=6, **kw)
        engine.lookup_ahead = True
        out, _, stats = engine.generate(prompt(), params)
        assert out == want
        if kw["mode"] == "lookup":
            assert oracle.calls > 0
        total += stats.lookup_accepted
    if kw["mode"] == "lookup":
        assert total > 0


@pytest.mark.parametrize("kw", [dict(mode="lookup"), dict(mode="sd", tree_policy="adaptive")], ids=["lookup", "adaptive"])
def test_runs_take_a_reference_as_the_hosts_steps_do(pair, device_oracle, kw):
    """Benchmarks' reference tokens (verify.Reference) in runs: the reference's tokens are emitted
    where the target's differ, and the overrides recorded (position, the target's own token, its gap)
    are those of the host's steps on the same request (float64)."""
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ref, oracle = device_oracle(prompt(), params)
    other = list(ref)
    for i in (3, 17, 30):
        other[i] = (ref[i] + 1) % pair[0].args.vocab_size
    got = {}
    for ahead_on in (False, True):
        engine = make_engine(pair, tree=TreeConfig(8, 3, 2), lookup_tokens=6, **kw)
        engine.lookup_ahead = ahead_on
        calls = oracle.calls
        out, _, st = engine.generate(prompt(), params, reference=other)
        assert out == other
        got[ahead_on] = (st.reference_positions, st.reference_chosen, st.reference_gaps)
        if ahead_on and kw["mode"] == "lookup":
            assert oracle.calls > calls  # runs were taken
    assert got[True][:2] == got[False][:2] and 3 in got[True][0]
    assert got[True][2] == pytest.approx(got[False][2], abs=1e-9)


def test_sample_rows_equal_the_hosts_sampler_row_by_row():
    """sampling.sample_rows (a run's rows, each with its own uniform) against next_token's host
    sampler drawing the same uniforms one by one."""
    from specextend.sampling import next_token, sample_rows

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9)
    logits = torch.randn(6, 40, generator=g, dtype=torch.float64)
    u = torch.rand(6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    rows = sample_rows(logits, params, u)
    draws = torch.Generator().manual_seed(9)
    assert rows.tolist() == [next_token(logits[r], params, draws) for r in range(6)]


def walked_rows(logits, params, u):
    """sample_rows' twin with sample_row's walk back from a zero-probability token, every row at once."""
    from specextend.sampling import target_probs

    probs = target_probs(logits, params)  # [R, V]
    cdf = probs.to(torch.float64).cumsum(-1)  # [R, V]
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).clamp_(max=probs.shape[-1] - 1)  # [R, 1]
    positions = torch.arange(probs.shape[-1])  # [V]
    nonzero_at_or_before = torch.where(probs > 0, positions, 0).cummax(-1).values  # [R, V]: 0 where none
    return nonzero_at_or_before.gather(-1, idx).squeeze(-1)  # [R]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sample_rows_needs_no_walk_back(dtype):
    """Without the walk back, sample_rows still never returns a zero-probability token: on
    distributions full of them (top-k, top-p, a tiny temperature, logits at -inf) and at the
    uniforms' edges (0, just below 1, and draws that land on a token's cumulative sum)."""
    from specextend.sampling import sample_rows, target_probs

    g = torch.Generator().manual_seed(1)
    settings = [SamplingParams(4, temperature=0.7, top_k=3), SamplingParams(4, temperature=1.0, top_p=0.5),
                SamplingParams(4, temperature=1e-6), SamplingParams(4, temperature=0.9, top_k=7, top_p=0.8)]
    for trial in range(40):
        logits = torch.randn(6, 50, generator=g).to(dtype)
        logits[:, torch.randperm(50, generator=g)[:20]] = float("-inf")
        params = settings[trial % len(settings)]
        probs = target_probs(logits, params)
        cdf = probs.to(torch.float64).cumsum(-1)
        edges = [0.0, 1.0 - 2.0 ** -53] + (cdf[:, :4] / cdf[:, -1:]).flatten().tolist()
        for e in range(0, len(edges), 6):
            u = torch.tensor((edges[e:e + 6] + [0.5] * 6)[:6], dtype=torch.float64)
            got = sample_rows(logits, params, u)
            assert got.tolist() == walked_rows(logits, params, u).tolist()
            assert all(probs[r, t] > 0 or t == 0 for r, t in enumerate(got.tolist()))


def test_no_run_from_an_index_out_of_step_with_the_cache(pair):
    from specextend.lookup import RequestLookup
    from specextend.lookup_ahead import in_step
    from specextend.target import TargetSession

    target = TargetSession(pair[0].decoder, 64, hybrid=True)
    target.cache.length = 10
    lookup = RequestLookup(ContextIndex(list(range(11)), 64), 6)
    assert in_step(target, lookup)
    lookup.index.extend([3])
    assert not in_step(target, lookup)


def test_warm_up_runs_lookup_steps_where_requests_would(pair):
    """The start-up warm-up takes a couple of lookup-run steps (their kernels compile then, not on
    a request's path) where requests would run ahead, and none where they would not."""
    from specextend.warmup import warm_lookup_runs

    engine = make_engine(pair, mode="lookup", lookup_tokens=6)
    assert warm_lookup_runs(engine, prompt()) == 0  # on the CPU runs are off
    engine.lookup_ahead = True
    assert warm_lookup_runs(engine, prompt()) == 2
    assert warm_lookup_runs(make_engine(pair, mode="ar"), prompt()) == 0


def test_sampled_requests_take_runs_where_the_kernels_sample_them():
    """Where the forward would take runs, greedy requests and those fused_sample's kernels sample
    (no top-p) run ahead; top-p ones take the host's steps (PyTorch's sort per row: measured slower
    in runs), unless forced (tests, A/Bs)."""
    from types import SimpleNamespace

    from specextend.lookup import RequestLookup
    from specextend.lookup_ahead import runs_ahead

    model = SimpleNamespace(graphs=SimpleNamespace(takes_device_length=lambda t: True))
    lookup = RequestLookup(ContextIndex(list(range(11)), 64), 6)
    greedy, sampled = SamplingParams(8), SamplingParams(8, temperature=0.7, seed=1)
    top_p = SamplingParams(8, temperature=0.7, top_p=0.9, seed=1)
    assert runs_ahead(model, greedy, lookup, None, None) and runs_ahead(model, sampled, lookup, None, None)
    assert not runs_ahead(model, top_p, lookup, None, None)
    assert runs_ahead(model, top_p, lookup, None, True) and not runs_ahead(model, greedy, lookup, None, False)
    model.graphs = None  # (the CPU: no full-step graphs)
    assert not runs_ahead(model, greedy, lookup, None, None)


def recorded_run(pair, device_oracle, calls: list) -> None:
    """A 60-token `lookup` request with runs forced on `pair`, its policy's record_forward and
    record_plain calls appended to `calls` as ("forward", rows, s) and ("plain", step_s)."""
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    device_oracle(prompt(), params)
    engine = make_engine(pair, mode="lookup", lookup_tokens=6)
    engine.lookup_ahead = True

    def controller(tree):
        ctl = engine.__class__.new_controller(engine, tree)
        real_forward, real_plain = ctl.record_forward, ctl.record_plain
        ctl.record_forward = lambda rows, s: (calls.append(("forward", rows, s)), real_forward(rows, s))[1]
        ctl.record_plain = lambda step_s=None, lookup=0: (calls.append(("plain", step_s)), real_plain(step_s, lookup))[1]
        return ctl

    engine.new_controller = controller
    engine.generate(prompt(), params)


def test_a_run_teaches_the_policy_its_steps_cost(pair, device_oracle):
    """Every read of a run but its first records the time since the read before as the forward of
    the path's rows and as the step's wall time (no host work beyond the forward): the policy
    prices steps without a tree at what runs make them cost."""
    calls = []
    recorded_run(pair, device_oracle, calls)
    taught = [a for a, b in zip(calls, calls[1:])
              if a[0] == "forward" and b[0] == "plain" and isinstance(a[2], float) and a[2] == b[1]]
    assert len(taught) >= 5 and all(rows == 7 for _, rows, _ in taught)  # root + 6 chain rows
    untimed = [c for c in calls if c == ("plain", None)]
    assert untimed  # each run's first read teaches nothing (its time includes the run's start)


def test_a_runs_reads_teach_whole_steps_only(pair, device_oracle, monkeypatch):
    """With every forward 20 ms slower, no reading a run teaches is shorter than 20 ms: a run's
    last read, which follows the one before with no forward between them (at once on the CPU; on a
    GPU, a step done while the host was late), teaches nothing. Before, each run taught one such
    ~0 s reading as a 7-row forward, which pulled the steps' line towards a plain step priced at
    nothing (the real pair's e2e rows on an H200, 2026-11-30: 1e9 tokens/s predicted, no tree)."""
    calls = []
    monkeypatch.setattr(ahead, "LOOKUP_RUN_STEPS", 3)  # (runs that end by their count, not the request's)
    recorded_run((slow_target(pair[0]), pair[1]), device_oracle, calls)
    taught = [c[2] for c in calls if c[0] == "forward" and c[1] == 7 and isinstance(c[2], float)]
    assert len(taught) >= 3 and min(taught) >= 0.02

def test_the_flat_search_equals_the_per_row_one():
    """sampling.search_flat (several rows on a GPU: one cumulative sum over the rows end to end)
    against the per-row search, on distributions full of zeros and at u = 0: the same token, never
    one of zero probability (but where u is 0, as the per-row search)."""
    from specextend.sampling import search, search_flat, target_probs

    g = torch.Generator().manual_seed(3)
    for trial in range(50):
        rows = 1 + trial % 9
        logits = torch.randn(rows, 60, generator=g, dtype=torch.float64) * 3
        logits[:, torch.randperm(60, generator=g)[:25]] = float("-inf")
        probs = target_probs(logits, SamplingParams(4, temperature=0.8, top_p=0.9))
        u = torch.rand(rows, generator=g, dtype=torch.float64)
        u[0] = 0.0 if trial % 5 == 0 else u[0]
        got = search_flat(probs, u)
        assert got.tolist() == search(probs, u).tolist()
        assert all(probs[r, t] > 0 or u[r] == 0 for r, t in enumerate(got.tolist()))
