"""Plain steps ahead (docs/architecture.md, "Plain steps ahead"): a greedy request that decodes
plainly throughout queues each forward before reading the token before it. Its slow twin is the
same engine with plain_ahead=false (each token read before the next forward); the tokens, finish
reasons and the forwards' count must be those of the twin, alone and batched."""

from __future__ import annotations

import time

import pytest
import torch

from specextend.config import SamplingParams, TreeConfig
from specextend.controller import TreeController
from specextend.emit import Emitter, StepEvent
from specextend.ladder import PLAIN, ladder
from specextend.plain_ahead import RUN_TOKENS, run_length
from specextend.stats import RequestStats
from specextend.models.batch import ForwardCall
from specextend.sampling import next_token, next_token_tensor
from specextend.session_calls import DraftCall

from helpers import make_engine
from test_batch import run_batched


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _trace(engine, prompt, params, on_event=None, **kw):
    """Drives a session by hand: (tokens, finish, the sequence of 'F' (a one-token forward), 'V' (a
    verification's) and 'E' (an event)); `on_event(n)` is called at the n-th event (1, 2, ...)."""
    co, send, order, tokens, finish = engine.session(prompt, params, **kw), None, [], [], None
    try:
        while True:
            item = co.send(send)
            send = None
            if isinstance(item, ForwardCall):
                order.append("P" if item.prompt else "F" if item.ids.shape[0] == 1 else "V")  # V: a tree's
                send = item.run(engine.target.decoder)
            elif isinstance(item, DraftCall):
                send = item.result()
            elif isinstance(item, StepEvent):
                order.append("E")
                tokens += item.token_ids
                finish = item.finish_reason
                if on_event is not None:
                    on_event(order.count("E"))
    except StopIteration:
        pass
    return tokens, finish, "".join(o for o in order if o != "P")


@pytest.mark.parametrize("max_new", [1, 2, 3, 17])
def test_ahead_equals_its_twin_and_queues_one_forward_ahead(pair, max_new):
    ahead, twin = make_engine(pair, "ar"), make_engine(pair, "ar", plain_ahead=False)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    got, want = _trace(ahead, _prompt(40, 1), params), _trace(twin, _prompt(40, 1), params)
    assert got[:2] == want[:2] and got[1] == "length" and len(got[0]) == max_new
    # the twin: E (the first token, from the prefill), then F E per token; ahead: after the first
    # token's forward, every token's event comes after the forward queued on it, and none past the end
    assert want[2] == "E" + "FE" * (max_new - 1)
    assert got[2] == ("E" if max_new == 1 else "EF" + "FE" * (max_new - 2) + "E")
    assert got[2].count("F") == want[2].count("F")
    steps = [ahead.generate(_prompt(40, 1), params)[2], twin.generate(_prompt(40, 1), params)[2]]
    assert [st.ahead_steps for st in steps] == [max_new - 1, 0]  # (responses and /metrics report it)


def test_a_stop_token_ends_it_where_the_twin_ends(pair):
    ahead, twin = make_engine(pair, "ar"), make_engine(pair, "ar", plain_ahead=False)
    prompt = _prompt(30, 2)
    free = twin.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    stop = free[6]  # a token the request emits: it ends there (or earlier, where it came before)
    params = SamplingParams(max_new_tokens=20, stop_token_ids=[stop], ignore_eos=True)
    got, want = _trace(ahead, prompt, params), _trace(twin, prompt, params)
    assert got[:2] == want[:2] and got[1] == "stop" and got[0][-1] == stop and len(got[0]) <= 7
    assert got[2].count("F") == want[2].count("F") + 1  # the one forward queued on the stop token


def test_sampled_requests_go_ahead_with_the_twins_tokens(pair):
    """A sampled request goes ahead too: its uniforms drawn on the host in the twin's order, the
    inverse-CDF sample on the device (sampling.next_token_tensor)."""
    ahead, twin = make_engine(pair, "ar"), make_engine(pair, "ar", plain_ahead=False)
    for kw in (dict(temperature=0.8, seed=7), dict(temperature=1.3, top_k=5, top_p=0.9, seed=8)):
        params = SamplingParams(max_new_tokens=9, ignore_eos=True, **kw)
        got, want = _trace(ahead, _prompt(20, 3), params), _trace(twin, _prompt(20, 3), params)
        assert got[:2] == want[:2] and got[2] == "EF" + "FE" * 7 + "E" and want[2] == "E" + "FE" * 8


def test_speculative_engines_go_ahead_only_where_speculation_is_off(pair):
    """A speculative engine's requests read each token first (their lookup and draft need it),
    except a request with speculation off (no lookup, no draft)."""
    spec = make_engine(pair, "specextend", tree_policy="adaptive")
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    off = _trace(spec, _prompt(20, 3), params, speculate=False)
    assert off[2] == "EF" + "FE" * 3 + "E"
    assert off[0] == _trace(make_engine(pair, "ar", plain_ahead=False), _prompt(20, 3), params)[0]
    on = _trace(spec, _prompt(20, 3), params)
    assert "FF" not in on[2] and on[0] == off[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_next_token_tensor_equals_next_token(dtype):
    """The device path's token and generator use equal the host path's, over random rows, vocabulary
    sizes and sampling settings (greedy, temperatures, top-k and top-p zeroing tokens)."""
    settings = [dict(), dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.9, top_p=0.8),
                dict(temperature=1.3, top_k=20, top_p=0.6), dict(temperature=1e-8), dict(temperature=2.0, top_k=1)]
    rows = torch.Generator().manual_seed(0)
    for trial in range(60):
        vocab = (97, 1000)[trial % 2]
        logits = (torch.randn(vocab, generator=rows, dtype=torch.float64) * (1 + trial % 5)).to(dtype)
        if trial % 3 == 0:
            logits[:vocab // 3] = float("-inf")  # leading tokens that can never be drawn
        for i, kw in enumerate(settings):
            params = SamplingParams(max_new_tokens=1, **kw)
            g1, g2 = torch.Generator().manual_seed(trial * 10 + i), torch.Generator().manual_seed(trial * 10 + i)
            got = next_token_tensor(logits, params, g1)
            assert got.shape == (1,) and got.dtype == torch.int64
            assert int(got) == next_token(logits, params, g2), (trial, kw)
            assert torch.rand((), generator=g1) == torch.rand((), generator=g2)  # the same draws used


def test_batched_sessions_ahead_equal_the_twin_alone(pair):
    """Sessions of different lengths through one Batcher, greedy and sampled, a stop token among
    them: each equals its own run alone with plain_ahead=false."""
    ahead, twin = make_engine(pair, "ar", prefill_chunk=64), make_engine(pair, "ar", prefill_chunk=64, plain_ahead=False)
    reqs = []
    for i, n in enumerate([3, 30, 150, 70, 9]):
        extra = {"temperature": 0.8, "seed": 100 + i} if i == 3 else {}
        reqs.append((_prompt(n, 10 + i), SamplingParams(max_new_tokens=8 + 6 * i, ignore_eos=True, **extra), {}))
    free = twin.generate(reqs[1][0], reqs[1][1])[0]
    reqs[1] = (reqs[1][0], SamplingParams(max_new_tokens=14, ignore_eos=True, stop_token_ids=[free[4]]), {})
    alone = [twin.generate(p, params) for p, params, _ in reqs]
    got, b = run_batched(ahead, reqs, max_batch=4)
    for (tokens, finish, _), (ref, ref_finish, _) in zip(got, alone):
        assert tokens == ref and finish == ref_finish
    assert got[1][1] == "stop" and b.max_calls == 4


class _ProbeEvery(TreeController):
    """Plain steps, and a tree every 5th step (a probe): the plain steps between are runs ahead."""

    every = 5

    def best(self):  # (between its probes: what a run asks before it follows the last, plain_still_best)
        return PLAIN

    def choose(self, sessions=1):
        self.begin_step()
        self.probe_every = self.every
        if self.since_probe >= self.probe_every:
            self.since_probe = 0
            return self.top
        return PLAIN


@pytest.mark.parametrize("sampled", [False, True])
def test_a_speculative_requests_plain_steps_run_ahead_between_its_trees(pair, ar_engine, sampled):
    """Where the policy takes plain steps with no context lookup chain worth verifying, they run
    ahead up to the next probe (plain_ahead.run_length); the probes' trees come as due, and the
    output is plain decoding's, greedy or sampled; with plain_ahead=false the same steps read each
    token first."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, **({"temperature": 0.9, "seed": 5} if sampled else {}))
    want = ar_engine.generate(_prompt(50, 4), params)[0]
    traces = {}
    for ahead in (True, False):
        engine = make_engine(pair, "specextend", tree_policy="adaptive", lookup_tokens=0, plain_ahead=ahead)
        engine.new_controller = lambda tree: _ProbeEvery(ladder(tree))
        tokens, finish, order = _trace(engine, _prompt(50, 4), params)
        assert tokens == want and finish == "length"
        traces[ahead] = order
    assert "FF" in traces[True] and "FF" not in traces[False]  # a run: the next forward before the token
    assert traces[True].count("F") == traces[False].count("F")  # the same forwards, none wasted
    assert traces[True].count("V") == traces[False].count("V") >= 5  # the probes' trees, as due


class _Lookup:
    """What run_length asks of a request's lookup."""

    pays, priced = False, True

    def could_pay(self):
        return self.pays


def test_run_length_stops_at_chains_probes_rechecks_and_the_end():
    ctl, lookup = _ProbeEvery(ladder(TreeConfig(8, 3, 2))), _Lookup()
    out = Emitter(SamplingParams(max_new_tokens=100), [], RequestStats())
    ctl.probe_every, ctl.since_probe = 20, 0
    assert run_length(ctl, out, out.stats, lookup) == run_length(ctl, out, out.stats) == RUN_TOKENS
    lookup.pays = True  # a chain could be worth verifying: steps as usual
    assert run_length(ctl, out, out.stats, lookup) == 0
    lookup.pays, lookup.priced = False, False  # the gate has not measured a plain step's host work
    assert run_length(ctl, out, out.stats, lookup) == 0
    lookup.priced = True
    ctl.since_probe = 17  # the probe in 3 steps
    assert run_length(ctl, out, out.stats, lookup) == 3
    ctl.since_probe = 19  # in 1: a run of one gains nothing
    assert run_length(ctl, out, out.stats, lookup) == 0
    ctl.since_probe, out.stats.num_generated = 0, 96  # 4 tokens left
    assert run_length(ctl, out, out.stats, lookup) == 4
    ctl.recheck.pending = True  # a recheck of the plain step (recheck.py): one step, timed alone
    assert run_length(ctl, out, out.stats, lookup) == 0
    ctl.recheck.pending = False
    ctl.probe_every = 0  # no probe schedule yet (warm-up): no run
    assert run_length(ctl, out, out.stats, lookup) == 0
    # without a draft (mode lookup, a draft that can never pay or failed): no probe schedule to keep
    out.stats.num_generated = 0
    assert run_length(ctl, out, out.stats, lookup, speculative=False) == RUN_TOKENS
    assert run_length(ctl, out, out.stats, None, speculative=False) == RUN_TOKENS
    lookup.pays = True
    assert run_length(ctl, out, out.stats, lookup, speculative=False) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the device path: pinned copies, events, graph inputs"))])
def test_a_built_engine_ahead_equals_the_twin_alone_and_batched(device):
    """An engine as the CLI and the app build it; on a GPU with CUDA graphs, the token fed from
    the device into the graph's input buffer and read through a pinned copy and an event: greedy and
    sampled sessions ahead, alone and batched, equal the twin's run alone."""
    from dataclasses import replace

    from specextend.builder import build_engine
    from specextend.config import EngineConfig

    engine = build_engine(EngineConfig(target="random:llama-tiny", draft="random:llama-tiny-draft", mode="ar",
                                       device=device, dtype="float32", prefill_chunk=64))
    reqs = [(_prompt(n, 20 + i), SamplingParams(max_new_tokens=24, ignore_eos=True,
                                                **({"temperature": 0.8, "seed": i} if i % 2 else {})), {})
            for i, n in enumerate([5, 70, 130, 33])]
    engine.config = replace(engine.config, plain_ahead=False)
    twin = [engine.generate(p, params)[0] for p, params, _ in reqs]
    engine.config = replace(engine.config, plain_ahead=True)
    assert [engine.generate(p, params)[0] for p, params, _ in reqs] == twin
    got, _ = run_batched(engine, reqs, max_batch=4)
    assert [tokens for tokens, _, _ in got] == twin


@pytest.mark.parametrize("chains_pay", [False, True])
def test_lookup_only_requests_run_ahead_where_no_chain_pays(pair, ar_engine, monkeypatch, chains_pay):
    """Mode lookup (no draft): where the context lookup's gate takes no chain, plain steps run
    ahead; where it takes every chain found, those steps verify chains as before; plain
    decoding's output either way, with a prompt that repeats itself (chains to find)."""
    from specextend.lookup_gate import LookupGate

    monkeypatch.setattr(LookupGate, "use", lambda self, *a, **k: chains_pay)
    prompt = _prompt(40, 6) * 3
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = ar_engine.generate(prompt, params)[0]
    tokens, finish, order = _trace(make_engine(pair, "lookup"), prompt, params)
    assert tokens == want and finish == "length"
    if chains_pay:
        assert "V" in order  # chains verified
    else:
        # runs ahead (FF), one following another with no token read between (no EE before the end)
        assert "V" not in order and "FF" in order and "EE" not in order[:-1] and order.count("F") == len(want) - 1


class _ProbeLate(_ProbeEvery):
    """Plain steps, and a tree every 40th step: runs of RUN_TOKENS follow one another."""

    every = 40


def test_runs_follow_one_another_without_the_host_reading_between(pair, ar_engine):
    """Between its probes a speculative request's runs of RUN_TOKENS plain steps follow one another
    queued on the token not yet read (plain_ahead_co's `more`): no run's last token is read before
    the next run's first forward is queued ('EE' in the trace: two tokens read with no forward
    between, as where one run ended and the host read its last token before the next began). The
    output is plain decoding's; the twin without `more` (each run from a token read) has the same
    forwards."""
    import specextend.plain_ahead as pa

    params = SamplingParams(max_new_tokens=36, ignore_eos=True)
    want = ar_engine.generate(_prompt(50, 4), params)[0]
    traces = {}
    for seamless in (True, False):
        engine = make_engine(pair, "specextend", tree_policy="adaptive", lookup_tokens=0)
        engine.new_controller = lambda tree: _ProbeLate(ladder(tree))
        real = pa.plain_ahead_co
        if not seamless:  # the twin: each run ends with its tokens read
            pa.plain_ahead_co = lambda *a, more=None, **kw: real(*a, **kw)
        try:
            tokens, finish, order = _trace(engine, _prompt(50, 4), params)
        finally:
            pa.plain_ahead_co = real
        assert tokens == want and finish == "length"
        traces[seamless] = order
    body = traces[True][1:-1]  # (the first token, from the prefill; the last read with nothing after it)
    assert "EE" not in body and "V" not in body and body.count("F") >= 3 * RUN_TOKENS
    assert "EE" in traces[False][1:-1]  # (runs of RUN_TOKENS, each from a token read)
    assert traces[True].count("F") == traces[False].count("F")


def test_runs_price_the_plain_step_anew(pair, ar_engine):
    """Each token of a run ahead is a plain step priced at the interval between its read and the one
    before (plain_run_co's `teach`): a plain price measured slow once (a cold first step, a draft's
    open beside it: here 1 s) comes down to what the run's steps take. Before, runs taught the
    policy nothing and the price stayed, carried from request to request."""
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)
    want = ar_engine.generate(_prompt(50, 4), params)[0]
    made = []

    def new_controller(tree):
        ctl = _ProbeLate(ladder(tree))
        ctl.plain_forward = ctl.extra_plain = 1.0
        made.append(ctl)
        return ctl

    engine = make_engine(pair, "specextend", tree_policy="adaptive", lookup_tokens=0)
    engine.new_controller = new_controller
    tokens, finish, order = _trace(engine, _prompt(50, 4), params)
    assert tokens == want and "FF" in order  # (runs ran)
    ctl = made[0]
    assert ctl.plain_forward + ctl.extra_plain < 0.25 and ctl.forward.known  # (one reading a run, from 2 s)


def test_one_slow_interval_does_not_price_a_run(pair, monkeypatch):
    """A run's reading is the median of its intervals: one read that waited on the driver's other
    work (here the consumer holding the stream for 0.5 s at one token) leaves every reading at what
    the run's steps take; a mean would have read over 60 ms for that run."""
    readings = []
    real = TreeController.record_plain_run
    monkeypatch.setattr(TreeController, "record_plain_run",
                        lambda self, n, step_s=None: (readings.append(step_s), real(self, n, step_s))[1])
    engine = make_engine(pair, "specextend", tree_policy="adaptive", lookup_tokens=0)
    engine.new_controller = lambda tree: _ProbeLate(ladder(tree))
    _trace(engine, _prompt(50, 4), SamplingParams(max_new_tokens=40, ignore_eos=True),
           on_event=lambda n: time.sleep(0.5) if n == 12 else None)  # (inside a run of RUN_TOKENS)
    priced = [r for r in readings if r is not None]
    assert len(priced) >= 3 and max(priced) < 0.05, priced


class _TreesLater(TreeController):
    """Plain steps are best until 20 tokens in (as if a growing batch then made trees pay); the next
    probe is far off."""

    def best(self):
        return PLAIN if self.since_probe < 20 else self.top

    def choose(self, sessions=1):
        self.begin_step()
        self.probe_every = 1000
        return self.best()


def test_a_run_ends_where_the_policy_would_no_longer_choose_a_plain_step(pair, ar_engine, monkeypatch):
    """Before a run follows the last one the policy is asked whether a plain step is still its best
    (TreeController.plain_still_best); where it no longer is, the run ends and the next step is the
    policy's tree, long before the next probe. Without the question the runs go on to the end."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = ar_engine.generate(_prompt(50, 4), params)[0]
    traces = {}
    for asked in (True, False):
        if not asked:
            monkeypatch.setattr(TreeController, "plain_still_best", lambda self, *a: True)
        engine = make_engine(pair, "specextend", tree_policy="adaptive", lookup_tokens=0)
        engine.new_controller = lambda tree: _TreesLater(ladder(tree))
        tokens, finish, traces[asked] = _trace(engine, _prompt(50, 4), params)
        assert tokens == want and finish == "length"
    assert "V" in traces[True] and "V" not in traces[False]
