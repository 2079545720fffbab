"""StepStream, the per-session stream the client's steps take (docs/architecture.md, "Wire
protocol"): the same trees as unary Step, a stuck draft still times out into plain decoding, a
restarted server re-opens the stream or falls back, and the token is checked on the stream."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.base import DraftBackend, DraftError, DraftSessionParams, Retrieval, TreeBound
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.rpc import DraftServerThread, DraftServicer, GrpcDraftBackend
from specextend.rpc.auth import new_token
from specextend.v1 import draft_pb2 as pb
from specextend.v1 import draft_pb2_grpc
from test_rpc import PARAMS, FakeDraft, expected_tree

TREE = TreeConfig(8, 4, 3)
CONFIG = EngineConfig(mode="specextend", tree=TREE, retrieval=RetrievalConfig(chunk_size=8, top_k=10, every=2),
                      tree_policy="fixed")


def prompt(n=70, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plain_and_speculative(pair, backend, n=30):
    """(plain decoding's tokens, the speculative engine's tokens, its stats) on the same prompt."""
    target = pair[0]
    ref, _, _ = Engine(EngineConfig(mode="ar"), target, None).generate(prompt(), SamplingParams(n, ignore_eos=True))
    out, _, stats = Engine(CONFIG, target, backend).generate(prompt(), SamplingParams(n, ignore_eos=True))
    return ref, out, stats


class OnStep(DraftBackend):
    """Passes every call to `inner`; runs `hook(step)` before each step is passed on."""

    def __init__(self, inner: DraftBackend, hook) -> None:
        self.inner, self.hook = inner, hook

    def open(self, session_id, prompt_ids, params):
        self.inner.open(session_id, prompt_ids, params)

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        self.hook(step)
        return self.inner.step(session_id, step, accepted_tokens, retrieval, bound)

    def close(self, session_id):
        self.inner.close(session_id)


def test_streamed_trees_equal_unary_trees(tiny_models, monkeypatch):
    """The same draft (float64), two sessions fed the same steps: one over StepStream, one over
    unary Step; every tree is the same, retrieval and tree bounds included."""
    worker = DraftWorker(tiny_models("float64")[1].decoder)
    params = DraftSessionParams(TREE, CONFIG.retrieval, max_new_tokens=64)
    with DraftServerThread(worker) as server:
        streamed = GrpcDraftBackend(server.address, transport="grpc")
        unary = GrpcDraftBackend(server.address, transport="grpc", stream=False)
        for client, sid in ((streamed, "streamed"), (unary, "unary")):
            client.open(sid, prompt(), params)
        accepted = [prompt()[-1]]
        for step in range(6):
            retrieval = Retrieval((0, 2, 3, 5), 8) if step % 2 else None
            bound = TreeBound(nodes=4, depth=2) if step == 3 else None
            with monkeypatch.context() as m:  # the streamed client must not take unary Step
                m.setattr(DraftServicer, "Step", lambda *a: pytest.fail("unary Step on the stream path"))
                got = streamed.step("streamed", step, accepted, retrieval, bound)
            ref = unary.step("unary", step, accepted, retrieval, bound)
            assert got == ref
            accepted = [ref.tokens[0], ref.tokens[1]]  # the best node, then a "bonus" token
        for client, sid in ((streamed, "streamed"), (unary, "unary")):
            client.close(sid)
            client.shutdown()
    assert worker.num_sessions == 0
    worker.shutdown()


def test_stalled_draft_on_the_stream_falls_back_to_plain_decoding(tiny_models, caplog):
    """Step 3 stalls past the deadline (and its retry behind it): the engine decodes the rest
    plainly, with plain decoding's output."""
    pair = tiny_models("float64")
    release, calls = threading.Event(), []

    def stall(step):
        calls.append(step)
        if step == 3:
            release.wait(5.0)

    worker = DraftWorker(pair[1].decoder)
    with DraftServerThread(OnStep(worker, stall)) as server:
        client = GrpcDraftBackend(server.address, timeout_s=0.3, transport="grpc")
        with caplog.at_level(logging.WARNING, logger="specextend.rpc.client"):
            ref, out, stats = plain_and_speculative(pair, client)
        release.set()
        client.shutdown()
    assert out == ref and stats.fallback and stats.num_steps == 3
    assert "StepStream" in caplog.text and "DEADLINE_EXCEEDED, retrying" in caplog.text
    assert calls.count(3) == 1  # the retry found the step still running: not applied twice
    worker.shutdown()


@pytest.mark.parametrize("same_worker", [True, False], ids=["draft-survives", "draft-lost"])
def test_server_restart_mid_session_reopens_or_falls_back(tiny_models, same_worker):
    """The gRPC server restarts on its port between steps 4 and 5. Around the same worker (the draft
    process lived on) the next step re-opens the stream and speculation goes on; around a new
    worker the session is gone and the engine falls back. Either way the output is plain decoding's."""
    pair = tiny_models("float64")
    worker = DraftWorker(pair[1].decoder)
    state = {"server": DraftServerThread(worker)}
    port = int(state["server"].address.rsplit(":", 1)[1])
    client = GrpcDraftBackend(state["server"].address, timeout_s=5.0, transport="grpc")
    replacement = worker if same_worker else DraftWorker(pair[1].decoder)

    def restart(step):
        if step == 5:
            state["server"].stop()
            state["server"] = DraftServerThread(replacement, port=port)
            for _ in range(100):  # until the client's channel is connected again
                if client.health():
                    break
                time.sleep(0.05)

    try:
        ref, out, stats = plain_and_speculative(pair, OnStep(client, restart))
    finally:
        client.shutdown()
        state["server"].stop()
    assert out == ref
    if same_worker:
        assert not stats.fallback and stats.num_steps > 5
    else:
        assert stats.fallback and stats.num_steps == 5
    worker.shutdown()
    replacement.shutdown()


def test_stream_requires_the_token():
    """Without the token, or with a wrong one, StepStream is UNAUTHENTICATED and reaches nothing;
    a step of a session opened by the right client, sent by a client with a wrong token, fails."""
    fake, token = FakeDraft(), new_token()
    with DraftServerThread(fake, token=token) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            for metadata in ((), (("authorization", "Bearer " + new_token()),)):
                replies = stub.StepStream(iter([pb.StepRequest(session_id="s", step=0, accepted_tokens=[1])]),
                                          timeout=2.0, metadata=metadata)
                with pytest.raises(grpc.RpcError) as info:
                    list(replies)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert token not in (info.value.details() or "")
        client = GrpcDraftBackend(server.address, timeout_s=2.0, token=token, transport="grpc")
        client.open("s", [1, 2], PARAMS)
        stray = GrpcDraftBackend(server.address, timeout_s=2.0, token=new_token(), transport="grpc")
        with pytest.raises(DraftError, match="UNAUTHENTICATED"):
            stray.step("s", 0, [2])
        assert fake.applied == []
        assert client.step("s", 0, [2]) == expected_tree("s", 0, [2])
        client.close("s")
        for c in (client, stray):
            c.shutdown()


def test_server_without_step_stream_gets_unary_steps(caplog):
    """A draft server from before StepStream answers it UNIMPLEMENTED: the client sends that step,
    and every later one, as unary Step."""

    class OldServicer(DraftServicer):
        StepStream = draft_pb2_grpc.DraftServiceServicer.StepStream

    fake = FakeDraft()
    servicer = OldServicer(fake)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    client = GrpcDraftBackend(address, timeout_s=2.0)
    try:
        client.open("s", [1], PARAMS)
        with caplog.at_level(logging.WARNING, logger="specextend.rpc.client"):
            for step in range(3):
                assert client.step("s", step, [step + 5]) == expected_tree("s", step, [step + 5])
        assert not client.streaming and caplog.text.count("no StepStream") == 1
        assert [s for _, s, _ in fake.applied] == [0, 1, 2]
    finally:
        client.shutdown()
        server.stop(0).wait()
        servicer.shutdown()
