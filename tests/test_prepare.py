"""Prepared outcomes (docs/architecture.md, "Prepared outcomes"): while the target verifies, the draft
prepares the next trees for the likeliest verdicts; a verdict among them takes no step call. In
process, over the ZeroMQ step channel of a real server on 127.0.0.1, and refused over gRPC; float64,
every output against plain decoding."""

import threading
import time
from concurrent import futures

import pytest

from specextend.draft.base import DraftError
from specextend.draft.chaos import Chaos, ChaosDraft
from specextend.draft.worker import DraftWorker
from specextend.rpc import DraftServerThread, GrpcDraftBackend

from test_overlap import concurrently, run


class SlowVerdicts:
    """Forces 'the draft prepares while the target verifies': every verdict takes `delay_s` longer,
    and, given `answers` (each engine thread's prepares' Futures, answered_when_grown), waits for its
    latest answer to be in, as a target slower than any draft would (on a loaded host the answer
    could come after the verdict, and no prepared tree would be used)."""

    def __init__(self, monkeypatch, delay_s, answers=None):
        import specextend.engine_steps as engine_mod

        original = engine_mod.verify_tree

        def slow(*args, **kw):
            time.sleep(delay_s)
            if answers is not None:
                futures.wait(answers.get(threading.get_ident(), [])[-1:], timeout=10.0)
            return original(*args, **kw)

        monkeypatch.setattr(engine_mod, "verify_tree", slow)


def answered_when_grown(backend, answers: dict):
    """`backend`'s prepares answered once the draft has nothing left to grow (not when due: on a
    loaded CI host an answer due early held too little, and no prepared tree was used), each Future
    noted as its engine thread's latest in `answers`: with every verdict waiting for it
    (SlowVerdicts), which verdicts hit is the models', not the host's. -> backend."""
    prepare = backend.prepare

    def grown(session_id, step, accepted_tokens, retrieval, due_s):
        future = prepare(session_id, step, accepted_tokens, retrieval, 60.0)
        answers.setdefault(threading.get_ident(), []).append(future)
        return future
    backend.prepare = grown
    return backend


@pytest.mark.parametrize("mode", ["sd", "specextend"])
@pytest.mark.parametrize("dies", [False, True])
def test_prepared_outcomes_are_used_and_lossless(tiny_models, monkeypatch, mode, dies):
    """A prepare (sent as the verification is queued) answers the next trees for the likeliest
    verdicts; a verdict among them takes no step call and goes to the draft with the next prepare,
    with the retrieval selection due (specextend). The output equals plain decoding; prepared trees
    were really used; the draft failing in a prepare falls back as in a step."""
    pair = tiny_models("float64")
    answers = {}
    SlowVerdicts(monkeypatch, 0.02, answers)
    worker = DraftWorker(pair[1].decoder, overlap=True, prepare=True)
    calls = {"step": 0, "prepare": 0}

    class Counting(ChaosDraft):
        def step(self, *args, **kw):
            calls["step"] += 1
            return super().step(*args, **kw)

        def prepare(self, session_id, step, accepted_tokens, retrieval, due_s):
            calls["prepare"] += 1
            if dies and accepted_tokens:  # the first verdict that goes with a prepare
                raise DraftError("injected: the draft died in a prepare")
            return super().prepare(session_id, step, accepted_tokens, retrieval, due_s)

    ref, out, stats = run(pair, answered_when_grown(Counting(worker, Chaos()), answers), mode, draft_prepare=True)
    assert out == ref
    if dies:
        assert stats.fallback and stats.prepared_steps == 1
    else:
        # every step asked by a step call but those a prepare answered (unready ones: plain steps)
        assert stats.prepared_steps > 0 and calls["step"] + stats.prepared_steps == stats.num_steps + stats.unready_steps
        assert calls["prepare"] == stats.num_steps  # one per verification
        if mode == "specextend":  # (a refresh every 2 verified trees once the context passes the budget;
            # how many trees verify depends on timing: a loaded CI run verified 4 and refreshed once)
            assert stats.retrieval_refreshes >= 1
    worker.shutdown()


@pytest.mark.parametrize("transport,asks", [("zmq", False), ("zmq", True), ("grpc", False)])
def test_prepares_go_over_the_step_channel_and_concurrent_sessions_stay_lossless(tiny_models, monkeypatch, transport,
                                                                                  asks):
    """Over a real server on 127.0.0.1: with the ZeroMQ step channel the client prepares (the server
    said so when the session opened), prepared trees are used and every session's output equals
    plain decoding, with early asks for the misses (`asks`: the engine overlaps) or step calls;
    over gRPC alone there are no prepares (a prepare's answer is not a DraftTree), and the same
    holds with step calls only."""
    pair = tiny_models("float64")
    answers = {}
    SlowVerdicts(monkeypatch, 0.02, answers)  # (one stressed run used no prepared tree without answered_when_grown)
    worker = DraftWorker(pair[1].decoder, overlap=True, prepare=True)
    results, prepares = {}, {}
    with DraftServerThread(worker) as server:
        def one(seed):
            client = answered_when_grown(GrpcDraftBackend(server.address, transport=transport), answers)
            results[seed] = run(pair, client, "specextend", seed=seed, draft_prepare=True, draft_overlap=asks)
            prepares[seed] = client.supports_prepare
            client.shutdown()

        concurrently(one, (1, 2))
    for seed, (ref, out, stats) in results.items():
        assert out == ref, seed
    used = sum(stats.prepared_steps for _, _, stats in results.values())
    if transport == "zmq" and not asks:
        assert all(prepares.values()) and used > 0
    elif transport == "zmq":  # (whether an answer crosses back before its verdict is timing's: the
        # in-process test asserts hits; here the misses' early asks behind the prepares, in order)
        assert all(prepares.values()) and sum(stats.asked_steps for _, _, stats in results.values()) > 0
    else:
        assert not any(prepares.values()) and used == 0
    assert worker.num_sessions == 0
    worker.shutdown()


def test_outcomes_cross_the_wire_unchanged_and_grpc_refuses_a_prepare(tiny_models):
    from specextend.draft.base import DraftTree, Outcomes
    from specextend.rpc.convert import outcomes_from_proto, outcomes_to_proto, prepare_to_proto
    from specextend.v1 import draft_pb2 as pb

    tree = DraftTree(step=5, tokens=(3, 4), parents=(-1, 0), draft_cache_tokens=70, ready=True, ahead_depth=2)
    outs = Outcomes(5, (((7, 8), tree), ((9,), tree)), server_s=0.002, queued_s=0.0001)
    back = outcomes_from_proto(pb.Outcomes.FromString(outcomes_to_proto(outs).SerializeToString()))
    assert back == outs and back.get([9]) == tree and back.get([8]) is None
    assert back.server_s == pytest.approx(0.002) and back.queued_s == pytest.approx(0.0001)
    worker = DraftWorker(tiny_models("float64")[1].decoder, overlap=True, prepare=True)
    with DraftServerThread(worker) as server:
        client = GrpcDraftBackend(server.address, transport="grpc")
        with pytest.raises(DraftError, match="step channel"):
            client._call("Step", prepare_to_proto("s", 1, [5], None, 0.001), 5.0)
        client.shutdown()
    worker.shutdown()


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_a_prepared_hit_takes_no_ask_and_a_miss_asks_at_its_verdict(tiny_models, monkeypatch, policy):
    """With early asks (the default) the prepare's answer is looked at when the verdict is known:
    a verdict among its trees takes no call, any other is asked at once, behind the prepare in the
    session's lane; with the adaptive policy plain steps' tells go through the same lane. Lossless
    in float64 (greedy and seeded sampling); both kinds of step were met; every call in order (the
    worker refuses a step number out of order, which would fail the request)."""
    from specextend.config import SamplingParams
    from specextend.controller import TreeController
    from specextend.engine import Engine
    from specextend.ladder import ladder
    from test_overlap import TREE, EngineConfig, RetrievalConfig, prompt

    pair = tiny_models("float64")
    answers = {}
    SlowVerdicts(monkeypatch, 0.02, answers)
    used = asked = told = 0
    for params in (SamplingParams(40, ignore_eos=True), SamplingParams(40, ignore_eos=True, temperature=0.9, seed=5)):
        worker = answered_when_grown(DraftWorker(pair[1].decoder, overlap=True, prepare=True), answers)
        cfg = EngineConfig(mode="specextend", tree=TREE, retrieval=RetrievalConfig(chunk_size=8, top_k=10, every=2),
                           tree_policy=policy, draft_prepare=True, draft_overlap=True)
        ref = Engine(EngineConfig(mode="ar"), pair[0], None).generate(prompt(70, 3), params)[0]
        engine = Engine(cfg, pair[0], worker)
        if policy == "adaptive":  # two trees, then a plain step: tells and prepares share the lane
            class TwoTreesOnePlain(TreeController):
                def choose(self, sessions=1):
                    self.begin_step()
                    n = self.spec_steps + self.plain_steps + self.unready_steps
                    return self.rungs[0] if n % 3 == 2 else self.top
            engine.new_controller = lambda tree: TwoTreesOnePlain(ladder(tree))
        out, _, stats = engine.generate(prompt(70, 3), params)
        assert out == ref and not stats.fallback
        used += stats.prepared_steps
        asked += stats.asked_steps
        told += stats.told_steps
        worker.shutdown()
    assert used > 0, "no prepared tree was used"
    assert asked > 0 if policy == "fixed" else told > 0
