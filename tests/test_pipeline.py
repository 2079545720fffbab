"""Pipelined drafting (DESIGN 4): the draft drafts the next tree ahead of its request, guessing
that the target accepts its best branch and then emits the draft's own next token.

A right guess must give exactly the tree a normal step would draft (so acceptance and output are
unchanged), a wrong or abandoned guess must leave no trace, and the output stays the target's own
greedy output through a real gRPC server with pipelining on.
"""

import pytest
import torch

from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.base import DraftSessionParams, Retrieval
from specextend.draft.inprocess import InProcessDraft
from specextend.draft.session import DraftSession, best_branch
from specextend.engine import Engine
from specextend.rpc import DraftServerThread, GrpcDraftBackend

TREE = TreeConfig(12, 4, 3)
PARAMS = DraftSessionParams(TREE, RetrievalConfig(), max_new_tokens=64)


def prompt(n=60, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def draft(tiny_models):
    return tiny_models("float64")[1].decoder


def test_right_guess_returns_the_tree_a_normal_step_drafts(draft):
    spec, plain = DraftSession(draft, prompt(), PARAMS), DraftSession(draft, prompt(), PARAMS)
    t0 = spec.step(0, [7], None)
    assert plain.step(0, [7], None) == t0
    spec.speculate(t0)
    guess = spec.speculation.path + (spec.speculation.bonus,)
    assert list(spec.speculation.path) == best_branch(t0) and spec.speculation.tree is not None
    hit = spec.step(1, list(guess), None)
    ref = plain.step(1, list(guess), None)
    assert hit.pipelined and not ref.pipelined and spec.pipeline_hits == 1
    assert (hit.step, hit.tokens, hit.parents, hit.draft_cache_tokens) == (
        ref.step, ref.tokens, ref.parents, ref.draft_cache_tokens)
    assert spec.step(2, [hit.tokens[0], 11], None) == plain.step(2, [ref.tokens[0], 11], None)


@pytest.mark.parametrize("case", ["wrong bonus", "shorter path", "abandoned", "retrieval due"])
def test_wrong_or_abandoned_guess_leaves_no_trace(draft, case):
    params = DraftSessionParams(TREE, RetrievalConfig(enabled=True, chunk_size=8, top_k=4), 64)
    spec, plain = DraftSession(draft, prompt(), params), DraftSession(draft, prompt(), params)
    t0 = spec.step(0, [7], None)
    plain.step(0, [7], None)
    calls = []
    stop = (lambda: calls.append(1) or len(calls) > 2) if case == "abandoned" else (lambda: False)
    spec.speculate(t0, stop)
    s = spec.speculation
    accepted = list(s.path) + [(s.bonus or 0) + 1]
    retrieval = None
    if case == "shorter path":
        accepted = list(s.path[:-1]) + [s.path[-1]]
    if case == "retrieval due":
        accepted = list(s.path) + [s.bonus]
        retrieval = Retrieval((0, 2, 5, 7), 8)
    got = spec.step(1, accepted, retrieval)
    ref = plain.step(1, accepted, retrieval)
    assert not got.pipelined and spec.pipeline_hits == 0
    assert got == ref
    assert spec.work.length == plain.work.length and spec.store.length == plain.store.length
    assert torch.equal(spec.work.data[:, :, :, :spec.work.length], plain.work.data[:, :, :, :plain.work.length])


def test_interrupt_stops_only_what_cannot_serve_the_request(draft):
    backend = InProcessDraft(draft)
    backend.open("a", prompt(), PARAMS)
    t0 = backend.step("a", 0, [7])
    seen = backend.requests_seen
    backend.interrupt("a", [1, 2])  # a request arrived before the speculation started: skip it
    backend.speculate("a", seen)
    assert backend._sessions["a"][0].speculation is None
    backend.speculate("a")
    spec = backend._sessions["a"][0].speculation
    assert spec is not None and spec.tree is not None
    hit = backend.step("a", 1, list(spec.path) + [spec.bonus])
    assert hit.pipelined and backend.pipeline_hits("a") == 1 and t0.step == 0


@pytest.mark.parametrize("same_model", [True, False], ids=["draft=target", "correlated draft"])
@pytest.mark.parametrize("mode", ["sd", "specextend"])
def test_pipelined_grpc_engine_is_lossless(tiny_models, same_model, mode):
    target, draft = tiny_models("float64")
    model = target.decoder if same_model else draft.decoder
    cfg = dict(mode=mode, tree=TREE)
    if mode == "specextend":
        cfg["retrieval"] = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    p = prompt(150, 4)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target, None).generate(p, params)
    runs = {}
    for pipeline in (False, True):
        with DraftServerThread(InProcessDraft(model), pipeline=pipeline) as server:
            client = GrpcDraftBackend(server.address, timeout_s=30.0)
            try:
                runs[pipeline] = Engine(EngineConfig(**cfg), target, client).generate(p, params)
            finally:
                client.shutdown()
    for pipeline, (out, _, stats) in runs.items():
        assert out == ref, f"pipeline={pipeline}"
    assert runs[False][2].pipeline_hits == 0
    if same_model and mode == "sd":  # every guess is right when the draft is the target (with
        assert runs[True][2].pipeline_hits > 0  # retrieval the tiny draft's pruned cache accepts ~0)
    # right guesses give the very trees a normal step drafts: same acceptance, step by step
    assert runs[True][2].accepted_per_step == runs[False][2].accepted_per_step
