"""Plain steps ahead (docs/architecture.md, "Plain steps ahead"): a greedy request that decodes
plainly throughout queues each forward before reading the token before it. Its slow twin is the
same engine with plain_ahead=false (each token read before the next forward); the tokens, finish
reasons and the forwards' count must be those of the twin, alone and batched."""

from __future__ import annotations

import pytest
import torch

from specextend.config import SamplingParams
from specextend.emit import StepEvent
from specextend.models.batch import ForwardCall

from helpers import make_engine
from test_batch import run_batched


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _trace(engine, prompt, params, **kw):
    """Drives a session by hand: (tokens, finish, the sequence of 'F' (a forward) and 'E' (an event))."""
    co, send, order, tokens, finish = engine.session(prompt, params, **kw), None, [], [], None
    try:
        while True:
            item = co.send(send)
            send = None
            if isinstance(item, ForwardCall):
                order.append("F" if not item.prompt else "P")
                send = item.run(engine.target.decoder)
            elif isinstance(item, StepEvent):
                order.append("E")
                tokens += item.token_ids
                finish = item.finish_reason
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


def test_a_stop_token_ends_it_where_the_twin_ends(pair):
    ahead, twin = make_engine(pair, "ar"), make_engine(pair, "ar", plain_ahead=False)
    prompt = _prompt(30, 2)
    free = twin.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    stop = free[6]  # a token the request emits: it ends there (or earlier, where it came before)
    params = SamplingParams(max_new_tokens=20, stop_token_ids=[stop], ignore_eos=True)
    got, want = _trace(ahead, prompt, params), _trace(twin, prompt, params)
    assert got[:2] == want[:2] and got[1] == "stop" and got[0][-1] == stop and len(got[0]) <= 7
    assert got[2].count("F") == want[2].count("F") + 1  # the one forward queued on the stop token


def test_sampling_lookup_and_references_keep_the_twin(pair):
    """Only greedy requests with every step plain go ahead: a sampled one, and a speculative engine's
    request (its lookup and draft), read each token first, as before."""
    ahead = make_engine(pair, "ar")
    sampled = _trace(ahead, _prompt(20, 3), SamplingParams(max_new_tokens=5, temperature=0.8, seed=7))
    assert sampled[2] == "E" + "FE" * 4
    spec = make_engine(pair, "specextend", tree_policy="adaptive")
    off = _trace(spec, _prompt(20, 3), SamplingParams(max_new_tokens=5, ignore_eos=True), speculate=False)
    assert off[2] == "EF" + "FE" * 3 + "E"  # speculation off for the request: no lookup, no draft
    assert off[0] == _trace(ahead, _prompt(20, 3), SamplingParams(max_new_tokens=5, ignore_eos=True))[0]


def test_batched_sessions_ahead_equal_the_twin_alone(pair):
    """Sessions of different lengths through one Batcher, greedy (ahead) and sampled (the twin), a
    stop token among them: each equals its own run alone with plain_ahead=false."""
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
