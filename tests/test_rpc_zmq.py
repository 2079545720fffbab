"""The ZeroMQ step channel (docs/architecture.md, "Wire protocol"): real sockets on 127.0.0.1 beside a
real gRPC server. The same trees as gRPC and in-process, the token, deadlines and late replies,
retries, a server stopping mid-step (plain decoding's output), a server without the channel,
reconnect, and many sessions at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import zmq

from specextend.draft.base import DraftError, DraftSessionParams, Retrieval, TreeBound
from specextend.draft.worker import DraftWorker
from specextend.rpc import DraftServerThread, DraftServicer, GrpcDraftBackend
from specextend.rpc.auth import new_token
from specextend.rpc.convert import step_to_proto
from specextend.rpc.zmq_client import StepChannelClient, StepFailed
from specextend.rpc.zmq_wire import TAG, decode_reply, encode_request
from specextend.v1 import draft_pb2 as pb
from test_rpc import PARAMS, FakeDraft, expected_tree
from test_rpc_stream import CONFIG, TREE, OnStep, plain_and_speculative, prompt


def request_bytes(session_id: str, step: int, accepted, timeout_ms: int = 2000) -> bytes:
    request = step_to_proto(session_id, step, accepted, None)
    request.timeout_ms = timeout_ms
    return request.SerializeToString()


def test_channel_trees_equal_grpc_and_in_process(tiny_models, channel_steps):
    """One float64 draft behind the server, a second in-process: three sessions fed the same steps
    (over ZeroMQ, over StepStream, called in place) get the same trees, retrieval and bounds included."""
    draft = tiny_models("float64")[1].decoder
    served, local = DraftWorker(draft), DraftWorker(draft)
    params = DraftSessionParams(TREE, CONFIG.retrieval, max_new_tokens=64)
    with DraftServerThread(served) as server:
        over_zmq = GrpcDraftBackend(server.address)
        over_grpc = GrpcDraftBackend(server.address, transport="grpc")
        clients = {"zmq": over_zmq, "grpc": over_grpc, "local": local}
        for sid, client in clients.items():
            client.open(sid, prompt(), params)
        assert over_zmq.step_endpoint == server.step_endpoint and over_grpc.step_endpoint is None
        accepted = [prompt()[-1]]
        for step in range(6):
            retrieval = Retrieval((0, 2, 3, 5), 8) if step % 2 else None
            bound = TreeBound(nodes=4, depth=2) if step == 3 else None
            trees = {sid: c.step(sid, step, accepted, retrieval, bound) for sid, c in clients.items()}
            assert trees["zmq"] == trees["grpc"] == trees["local"]
            accepted = [trees["local"].tokens[0], trees["local"].tokens[1]]
        for sid, client in clients.items():
            client.close(sid)
        over_zmq.shutdown()
        over_grpc.shutdown()
    assert channel_steps == {"zmq": list(range(6))}  # the gRPC client's steps did not take the channel
    assert served.num_sessions == local.num_sessions == 0
    served.shutdown()
    local.shutdown()


def test_wrong_token_is_unauthenticated_and_runs_nothing():
    """A step without the token, with a wrong one, or not a step at all, is refused before it is
    read; the session it names is untouched, and the right client carries on."""
    fake, token = FakeDraft(), new_token()
    with DraftServerThread(fake, token=token) as server:
        client = GrpcDraftBackend(server.address, timeout_s=2.0, token=token)
        client.open("s", [1, 2], PARAMS)
        assert client.step_endpoint == server.step_endpoint
        body = request_bytes("s", 0, [2])
        ctx = zmq.Context.instance()
        with ctx.socket(zmq.DEALER) as raw:
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(server.step_endpoint)
            right = token.encode()
            for frames, request_id, code in (
                ([encode_request(b"", 1, body)], 1, grpc.StatusCode.UNAUTHENTICATED),
                ([encode_request(new_token().encode(), 2, body)], 2, grpc.StatusCode.UNAUTHENTICATED),
                ([encode_request(right[:-1], 3, body)], 3, grpc.StatusCode.UNAUTHENTICATED),
                ([encode_request(b"Bearer " + right, 4, body)], 4, grpc.StatusCode.UNAUTHENTICATED),
                ([encode_request(right, 5, body).replace(TAG, b"specextend.v0.step")], 0,
                 grpc.StatusCode.INVALID_ARGUMENT),
                ([body], 0, grpc.StatusCode.INVALID_ARGUMENT),
                ([encode_request(right, 7, b"")[:-3]], 7, grpc.StatusCode.INVALID_ARGUMENT),  # token cut short
                ([TAG, right, body], 0, grpc.StatusCode.INVALID_ARGUMENT),  # multipart: not this protocol
                ([encode_request(right, 9, b"\xff\xff not protobuf")], 9, grpc.StatusCode.INVALID_ARGUMENT),
            ):
                raw.send_multipart(frames)
                assert raw.poll(2000), frames
                reply_id, status, details = decode_reply(raw.recv())
                assert (reply_id, status) == (request_id, code), frames
                assert right not in details
        for wrong in (None, new_token()):
            stray = StepChannelClient(server.step_endpoint, wrong)
            with pytest.raises(StepFailed) as info:
                stray.call(body, 2.0)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and token not in str(info.value)
            stray.close()
        assert fake.applied == []  # nothing reached the draft
        assert client.step("s", 0, [2]) == expected_tree("s", 0, [2])
        client.close("s")
        client.shutdown()


def test_deadline_drops_the_late_reply_and_the_next_step_works(fake):
    """A step the draft answers after the client's deadline fails DEADLINE_EXCEEDED within the
    bound; its reply, arriving later on the same socket, is recognised by its id and dropped."""
    with DraftServerThread(fake) as server:
        GrpcDraftBackend(server.address).open("s", [1], PARAMS)
        channel = StepChannelClient(server.step_endpoint)  # one thread: one socket, reused
        assert expected_tree("s", 0, [1]) == step_tree(channel.call(request_bytes("s", 0, [1]), 2.0))
        fake.slow_once[1] = 0.4
        start = time.monotonic()
        with pytest.raises(StepFailed) as info:
            channel.call(request_bytes("s", 1, [2], timeout_ms=5000), 0.1)  # the server would wait
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < 0.35
        (sock,) = channel._idle
        assert sock.sock.poll(2000)  # the late tree of step 1 is waiting on the socket
        assert step_tree(channel.call(request_bytes("s", 2, [3]), 2.0)) == expected_tree("s", 2, [3])
        assert [step for _, step, _ in fake.applied] == [0, 1, 2]
        channel.close()


def step_tree(body: bytes):
    from specextend.rpc.convert import tree_from_proto

    return tree_from_proto(pb.DraftTree.FromString(body))


def test_stuck_draft_fails_the_step_then_the_session_goes_on(fake):
    """Through the product's client: a stuck step fails with the deadline error in about two
    attempts' time (not the draft's 4 s); once the draft moves again, the next step works."""
    with DraftServerThread(fake) as server:
        client = GrpcDraftBackend(server.address, timeout_s=0.2)
        client.open("s", [1], PARAMS)
        fake.step_delay_s = 4.0
        start = time.monotonic()
        with pytest.raises(DraftError, match="exceeded its 0.2 s deadline"):
            client.step("s", 0, [1])
        assert time.monotonic() - start < 1.5
        fake.step_delay_s = 0.0
        fake.wake.set()  # step 0 completes (the first attempt was running; the retry was dropped)
        assert client.step("s", 1, [5]) == expected_tree("s", 1, [5])
        assert client.step_endpoint == server.step_endpoint  # still over the channel
        client.shutdown()


def test_retried_step_number_returns_the_same_tree(fake):
    with DraftServerThread(fake) as server:
        GrpcDraftBackend(server.address).open("s", [1], PARAMS)
        channel = StepChannelClient(server.step_endpoint)
        first = channel.call(request_bytes("s", 0, [7]), 2.0)
        again = channel.call(request_bytes("s", 0, [7]), 2.0)
        assert step_tree(first) == step_tree(again) == expected_tree("s", 0, [7])  # (their timings differ)
        assert len(fake.applied) == 1
        with pytest.raises(StepFailed) as info:  # and a step out of order maps as Step's does
            channel.call(request_bytes("s", 5, [7]), 2.0)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        channel.close()


def test_server_stopped_mid_step_falls_back_to_plain_decoding(tiny_models):
    """The server stops while step 3 is with the draft: the step fails at once (UNAVAILABLE over
    ZeroMQ, then over gRPC), and the engine decodes the rest plainly, with plain decoding's output."""
    pair = tiny_models("float64")
    worker = DraftWorker(pair[1].decoder)
    state: dict = {}

    def stop_during(step):
        if step == 3:
            stopper = threading.Thread(target=state["server"].stop)
            stopper.start()
            stopper.join()

    state["server"] = DraftServerThread(OnStep(worker, stop_during))
    client = GrpcDraftBackend(state["server"].address, timeout_s=5.0)
    try:
        start = time.monotonic()
        ref, out, stats = plain_and_speculative(pair, client)
        assert time.monotonic() - start < 4.0  # not a 5 s deadline, twice
    finally:
        client.shutdown()
        state["server"].stop()
    assert out == ref and stats.fallback and stats.num_steps == 3
    worker.shutdown()


def test_server_without_the_channel_gets_step_stream(fake, monkeypatch, channel_steps):
    """A server from before the channel (no step_endpoint in its replies): the client's steps go
    over StepStream, as with step_transport=grpc."""
    streams = []
    step_stream = DraftServicer.StepStream

    def counting(self, requests, context):
        streams.append(1)
        yield from step_stream(self, requests, context)

    monkeypatch.setattr(DraftServicer, "StepStream", counting)  # before the server registers it
    with DraftServerThread(fake, step_channel=None) as server:
        assert server.step_endpoint == ""
        client = GrpcDraftBackend(server.address, timeout_s=2.0)
        client.open("s", [1], PARAMS)
        for step in range(3):
            assert client.step("s", step, [step + 5]) == expected_tree("s", step, [step + 5])
        assert client.step_endpoint is None and client.server_health().ok
        client.shutdown()
    assert streams == [1] and channel_steps == {}


def test_lost_channel_steps_go_over_grpc(fake, caplog):
    """The channel is gone but DraftService answers: each step is retried as a unary Step and
    succeeds, the session goes on."""
    with DraftServerThread(fake) as server:
        client = GrpcDraftBackend(server.address, timeout_s=2.0)
        client.open("s", [1], PARAMS)
        assert client.step("s", 0, [1]) == expected_tree("s", 0, [1])
        server._channel.stop()
        with caplog.at_level("WARNING", logger="specextend.rpc.client"):
            for step in (1, 2):
                assert client.step("s", step, [step]) == expected_tree("s", step, [step])
        assert "UNAVAILABLE" in caplog.text and "retrying over gRPC" in caplog.text
        assert [step for _, step, _ in fake.applied] == [0, 1, 2]
        client.shutdown()


def test_reconnect_resets_the_channel(fake):
    """After reconnect() to a restarted draft (new address, new endpoint), the next step asks the
    new server where its channel is and takes it."""
    first = DraftServerThread(fake)
    client = GrpcDraftBackend(first.address, timeout_s=2.0)
    client.open("s", [1], PARAMS)
    client.step("s", 0, [1])
    first.stop()
    with DraftServerThread(fake) as restarted:
        client.reconnect(restarted.address)
        assert client.step_endpoint is None
        assert client.step("s", 1, [2]) == expected_tree("s", 1, [2])
        assert client.step_endpoint == restarted.step_endpoint != first.step_endpoint
    client.shutdown()
    with pytest.raises(DraftError, match="shut down"):
        client.step("s", 2, [3])


def test_many_sessions_at_once_over_few_sockets(fake, channel_steps):
    """16 threads step 16 sessions at once; no cross-talk, the backend serializes, and the client
    connects at most one socket per thread stepping at a time."""
    with DraftServerThread(fake) as server:
        client = GrpcDraftBackend(server.address, timeout_s=5.0)

        def run(i: int) -> None:
            sid = f"session-{i}"
            client.open(sid, [i] * (i + 1), PARAMS)
            for step in range(30):
                accepted = [i * 1000 + step, step]
                assert client.step(sid, step, accepted) == expected_tree(sid, step, accepted)
            client.close(sid)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(run, range(16)))
        assert len(fake.applied) == 16 * 30 and fake.sessions == {} and fake.max_active == 1
        assert all(steps == list(range(30)) for steps in channel_steps.values()) and len(channel_steps) == 16
        assert 1 <= len(client._steps._idle) <= 16
        client.shutdown()


def test_endpoints(fake, monkeypatch, tmp_path):
    """The channel on a Unix socket in a private directory (the default), removed when it stops;
    on loopback TCP when asked, or when no Unix socket can be made there."""
    import os

    with DraftServerThread(fake) as server:
        assert server.step_endpoint.startswith("ipc://")
        folder = os.path.dirname(server.step_endpoint.removeprefix("ipc://"))
        assert os.stat(folder).st_mode & 0o077 == 0
        client = GrpcDraftBackend(server.address)
        client.open("s", [1], PARAMS)
        assert client.step("s", 0, [4]) == expected_tree("s", 0, [4])
        client.shutdown()
    assert not os.path.exists(folder)
    long = tmp_path / ("x" * 120)  # longer than a Unix socket's path may be
    long.mkdir()
    monkeypatch.setenv("TMPDIR", str(long))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    for kind in ("ipc", "tcp"):
        with DraftServerThread(FakeDraft(), step_channel=kind) as server:
            assert server.step_endpoint.startswith("tcp://127.0.0.1:")
            client = GrpcDraftBackend(server.address)
            client.open("s", [1], PARAMS)
            assert client.step("s", 0, [4]) == expected_tree("s", 0, [4])
            client.shutdown()
    assert list(long.iterdir()) == []  # the failed attempt left no directory behind


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_step_transport_setting_reaches_actor_and_client(transport, channel_steps):
    """step_transport, a Serve argument: the draft actor serves the channel or not, the replica's
    client takes it or StepStream, and speculative decoding's output is plain decoding's."""
    from specextend.serving.draft_actor import DraftActor
    from specextend.serving.draft_actor import draft_client
    from specextend.serving.settings import AppSettings

    settings = AppSettings(target="random:llama-tiny", draft="random:llama-tiny-draft", num_gpus=0, dtype="float64",
                           step_transport=transport, tree_nodes=8, tree_depth=4, tree_topk=3, tree_policy="fixed",
                           retrieval_chunk_size=8, retrieval_top_k=10, retrieval_every=2, draft_timeout_s=5)
    token = new_token()
    actor = DraftActor(settings.to_engine_config(), token, step_transport=settings.step_transport)
    client = draft_client(settings, actor.address(), token)
    try:
        assert bool(actor.info()["step_endpoint"]) == (transport == "zmq")
        client.open("probe", [1, 2, 3], PARAMS)
        assert client.step_endpoint == (actor.info()["step_endpoint"] or None)
        client.close("probe")
        from specextend.config import EngineConfig, SamplingParams
        from specextend.engine import Engine
        from specextend.models.loader import load_model

        target = load_model("random:llama-tiny", dtype="float64", attention_backend="torch")
        ids = prompt()
        ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(ids, SamplingParams(24, ignore_eos=True))
        out, _, stats = Engine(settings.to_engine_config(), target, client).generate(ids, SamplingParams(24, ignore_eos=True))
        assert out == ref and not stats.fallback and stats.num_steps > 1
        assert (len(channel_steps) == 1) == (transport == "zmq")  # the engine's session took the channel, or not
    finally:
        client.shutdown()
        actor.__ray_shutdown__()
        actor.backend.shutdown()


def test_switch_interval_setting_reaches_the_draft_actor():
    """switch_interval_ms, a Serve argument, is the draft actor's process's too (the replica passes it)."""
    import sys

    from specextend.serving.draft_actor import DraftActor
    from specextend.serving.settings import AppSettings

    settings = AppSettings(target="random:llama-tiny", draft="random:llama-tiny-draft", num_gpus=0, dtype="float64",
                           switch_interval_ms=0.05)
    before = sys.getswitchinterval()
    actor = DraftActor(settings.to_engine_config(), new_token(), switch_interval_ms=settings.switch_interval_ms)
    try:
        assert sys.getswitchinterval() == pytest.approx(5e-5)
    finally:
        actor.__ray_shutdown__()
        sys.setswitchinterval(before)
