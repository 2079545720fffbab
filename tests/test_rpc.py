"""GrpcDraftBackend <-> DraftServicer over a real gRPC server on 127.0.0.1, with a fake draft; steps
over each transport: the ZeroMQ step channel (the default), StepStream and unary Step."""

from __future__ import annotations

import logging
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Optional, Sequence

import grpc
import pytest

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import (
    DraftBackend,
    DraftError,
    DraftSessionNotFound,
    DraftSessionParams,
    DraftStepOutOfOrder,
    DraftTree,
    Retrieval,
    TreeBound,
)
from specextend.rpc import DraftServerThread, GrpcDraftBackend
from specextend.v1 import draft_pb2 as pb
from specextend.v1 import draft_pb2_grpc

PARENTS = (-1, 0, 0, 1, 1)  # [N] a fixed 5-node tree shape


def expected_tree(session_id: str, step: int, accepted: Sequence[int]) -> DraftTree:
    """Deterministic in (session, step, accepted tokens), so any cross-talk changes the tree."""
    base = accepted[-1] + zlib.crc32(session_id.encode())
    return DraftTree(
        step=step,
        tokens=tuple((base + i) % 2**31 for i in range(len(PARENTS))),
        parents=PARENTS,
        draft_cache_tokens=7 * step + len(accepted),
    )


class FakeDraft(DraftBackend):
    """base.py's step contract: last+1 applies, last again = cached tree, else out of order."""

    def __init__(self) -> None:
        self.open_delay_s = self.step_delay_s = 0.0
        self.slow_once: dict[int, float] = {}  # step number -> seconds slept when first applied
        self.sessions: dict[str, dict] = {}
        self.applied: list[tuple[str, int, Optional[Retrieval]]] = []
        self.bounds: list[Optional[TreeBound]] = []  # each applied step's cap on the tree
        self.active = self.max_active = 0  # concurrent backend calls (the servicer serializes them)
        self.wake = threading.Event()  # set: a step sleeping its step_delay_s returns at once

    @contextmanager
    def _call(self):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            yield
        finally:
            self.active -= 1

    def open(self, session_id, prompt_ids, params):
        with self._call():
            if not prompt_ids:
                raise ValueError("empty prompt")
            if prompt_ids[0] < 0:
                raise RuntimeError("boom")
            time.sleep(self.open_delay_s)
            self.sessions[session_id] = dict(
                prompt=tuple(prompt_ids), params=params, last=-1, tree=None
            )

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        with self._call():
            if session_id not in self.sessions:
                raise DraftSessionNotFound(f"no draft session {session_id!r}")
            state = self.sessions[session_id]
            if step == state["last"]:
                return state["tree"]
            if step != state["last"] + 1:
                raise DraftStepOutOfOrder(f"step {step} after {state['last']}")
            delay = self.slow_once.pop(step, None)
            if delay is not None:
                time.sleep(delay)
            else:
                self.wake.wait(self.step_delay_s)
            state.update(last=step, tree=expected_tree(session_id, step, accepted_tokens))
            self.applied.append((session_id, step, retrieval))
            self.bounds.append(bound)
            return state["tree"]

    def close(self, session_id):
        with self._call():
            self.sessions.pop(session_id, None)


PARAMS = DraftSessionParams(
    tree=TreeConfig(nodes=8, depth=4, topk=2),
    retrieval=RetrievalConfig(
        enabled=True, chunk_size=16, top_k=8, every=2, sink_chunks=1, recent_chunks=2,
        draft_prefill_window=128,
    ),
    max_new_tokens=99,
)


@pytest.fixture
def server(fake):
    with DraftServerThread(fake, model="fake-draft") as server:
        yield server


# the client's step transports: the ZeroMQ step channel (test_rpc_zmq.py), StepStream
# (test_rpc_stream.py), unary Step
TRANSPORTS = {"zmq": {}, "stream": {"transport": "grpc"}, "unary": {"transport": "grpc", "stream": False}}


@pytest.fixture(params=list(TRANSPORTS))
def transport(request) -> dict:
    """GrpcDraftBackend's keyword arguments for one step transport."""
    return TRANSPORTS[request.param]


@pytest.fixture
def client(server, transport):
    """The product's client, its steps over one transport."""
    client = GrpcDraftBackend(server.address, timeout_s=2.0, open_timeout_s=5.0, **transport)
    yield client
    client.shutdown()


def test_round_trip_preserves_everything(fake, server, client):
    prompt = [0, 1, 151_643, 2**31 - 1] * 100
    client.open("s", prompt, PARAMS)
    assert fake.sessions["s"]["prompt"] == tuple(prompt)
    assert fake.sessions["s"]["params"] == PARAMS
    health = client.server_health()
    assert (health.ok, health.sessions, health.model) == (True, 1, "fake-draft")

    retrievals = [None, Retrieval((0, 3, 7, 2**31 - 1), 16), Retrieval((), 16)]
    for step, retrieval in enumerate(retrievals):
        accepted = [step + 10, 2**31 - 2][: step + 1]
        assert client.step("s", step, accepted, retrieval) == expected_tree("s", step, accepted)
    assert [r for _, _, r in fake.applied] == retrievals  # None stays absent; () stays present

    client.close("s")
    assert fake.sessions == {} and client.server_health().sessions == 0


def test_errors_map_to_draft_errors(server, client):
    with pytest.raises(DraftSessionNotFound, match="nope"):
        client.step("nope", 0, [1])
    client.open("s", [1, 2], PARAMS)
    client.step("s", 0, [3])
    with pytest.raises(DraftStepOutOfOrder, match="step 5 after 0"):
        client.step("s", 5, [4])
    with pytest.raises(DraftError, match="INVALID_ARGUMENT: empty prompt") as bad:
        client.open("t", [], PARAMS)
    with pytest.raises(DraftError, match="INTERNAL: RuntimeError: boom") as boom:
        client.open("t", [-1], PARAMS)
    assert type(bad.value) is DraftError and type(boom.value) is DraftError
    assert client.step("s", 1, [4]) == expected_tree("s", 1, [4])  # the server carries on

    with grpc.insecure_channel(server.address) as channel:  # no config: validated server side
        with pytest.raises(grpc.RpcError) as raw:
            draft_pb2_grpc.DraftServiceStub(channel).OpenSession(
                pb.OpenSessionRequest(session_id="raw", prompt_ids=[1]), timeout=2.0
            )
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_deadline_raises_draft_error(fake, server, transport):
    fake.step_delay_s = 4.0
    client = GrpcDraftBackend(server.address, timeout_s=0.1, **transport)
    client.open("s", [1], PARAMS)
    start = time.monotonic()
    with pytest.raises(DraftError, match="exceeded its 0.1 s deadline"):
        client.step("s", 0, [1])
    # two attempts of 0.1 s, not the backend's 4 s (a wide margin: CI machines are loaded; 1.0 s
    # was seen there against 0.45 s expected)
    assert time.monotonic() - start < 2.0
    fake.wake.set()  # end the backend's step now: its worker thread must not outlive the test
    client.shutdown()


def test_retried_step_is_applied_once(fake, server, caplog, transport):
    client = GrpcDraftBackend(server.address, timeout_s=0.3, **transport)
    client.open("s", [1], PARAMS)
    client.step("s", 0, [1])
    fake.slow_once[1] = 0.45  # applied, but after the first attempt's deadline
    with caplog.at_level(logging.WARNING, logger="specextend.rpc.client"):
        assert client.step("s", 1, [2, 3]) == expected_tree("s", 1, [2, 3])
    assert "DEADLINE_EXCEEDED, retrying" in caplog.text
    assert client.step("s", 2, [4]) == expected_tree("s", 2, [4])
    assert [step for _, step, _ in fake.applied] == [0, 1, 2]
    client.shutdown()


def test_concurrent_sessions_do_not_cross_talk(fake, client):
    def run(i: int) -> None:
        sid = f"session-{i}"
        client.open(sid, [i] * (i + 1), PARAMS)
        for step in range(25):
            accepted = [i * 1000 + step, step]
            assert client.step(sid, step, accepted) == expected_tree(sid, step, accepted)
        client.close(sid)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run, range(8)))
    assert len(fake.applied) == 8 * 25 and fake.sessions == {}
    assert fake.max_active == 1  # backend calls were serialized


def test_close_is_idempotent(client):
    client.open("s", [1], PARAMS)
    client.close("s")
    client.close("s")
    client.close("never-opened")
    assert client.server_health().sessions == 0


def test_server_stop_fails_fast(fake, transport):
    server = DraftServerThread(fake)
    client = GrpcDraftBackend(server.address, timeout_s=5.0, **transport)
    client.open("s", [1], PARAMS)
    server.stop()
    start = time.monotonic()
    with pytest.raises(DraftError, match="unavailable"):
        client.step("s", 0, [1])
    client.close("s")  # logged, not raised
    assert not client.health()
    assert time.monotonic() - start < 2.0  # no hang until the 5 s deadline

    with DraftServerThread(fake) as restarted:  # a restarted draft: new address
        client.reconnect(restarted.address)
        assert client.address == restarted.address
        assert client.step("s", 0, [1]) == expected_tree("s", 0, [1])
    client.shutdown()
    with pytest.raises(DraftError, match="shut down"):
        client.step("s", 1, [2])
    client.close("s")


def test_start_failure_raises():
    with DraftServerThread(FakeDraft()) as first:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(RuntimeError):
            DraftServerThread(FakeDraft(), port=port)


def test_abandoned_calls_leave_nothing_behind(fake, server, client):
    impatient = GrpcDraftBackend(server.address, timeout_s=0.1, open_timeout_s=0.1)
    fake.open_delay_s = 0.3
    with pytest.raises(DraftError, match="deadline"):
        impatient.open("running", [1], PARAMS)  # reaches the backend, then the caller gives up
    with pytest.raises(DraftError, match="deadline"):
        impatient.open("queued", [1], PARAMS)  # expires while queued: never reaches the backend
    fake.open_delay_s = 0.0
    client.open("s", [1], PARAMS)  # queued behind both: by now "running" has been undone
    assert set(fake.sessions) == {"s"} and client.server_health().sessions == 1
    impatient.shutdown()


def test_stop_releases_threads(fake):
    """The server's own threads (its loop, the worker it put in front of a plain backend) end."""
    before = set(threading.enumerate())
    with DraftServerThread(fake) as server:
        GrpcDraftBackend(server.address).open("s", [1], PARAMS)
    deadline = time.monotonic() + 1.0

    def started():
        return [t.name for t in set(threading.enumerate()) - before if t.name.startswith("draft-")]

    while time.monotonic() < deadline and started():
        time.sleep(0.01)
    assert not started()


def test_token_keeps_stray_clients_out(fake, caplog):
    """With a token (as the served app always runs it), a plain gRPC client without it, or with a
    wrong one, is UNAUTHENTICATED on every method and reaches nothing; the right one works."""
    from specextend.rpc.auth import new_token

    token = new_token()
    caplog.set_level(logging.DEBUG)
    with DraftServerThread(fake, model="fake-draft", token=token) as server:
        assert server.address.startswith("127.0.0.1:")
        with grpc.insecure_channel(server.address) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            calls = {"OpenSession": pb.OpenSessionRequest(session_id="x", prompt_ids=[1]),
                     "Step": pb.StepRequest(session_id="x", step=0, accepted_tokens=[1]),
                     "CloseSession": pb.CloseSessionRequest(session_id="x"),
                     "Health": pb.HealthRequest()}
            near = token[:-1] + ("B" if token.endswith("A") else "A")  # one character off (never the token)
            for metadata in ((), (("authorization", "Bearer " + near),),
                             (("authorization", token),), (("x-token", token),)):
                for method, request in calls.items():
                    with pytest.raises(grpc.RpcError) as info:
                        getattr(stub, method)(request, timeout=2.0, metadata=metadata)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
                    assert token not in (info.value.details() or "")
        for wrong in (None, new_token()):
            stray = GrpcDraftBackend(server.address, timeout_s=2.0, token=wrong)
            with pytest.raises(DraftError, match="UNAUTHENTICATED"):
                stray.open("s", [1], PARAMS)
            assert not stray.health()
            stray.shutdown()
        assert fake.sessions == {} and fake.applied == []
        client = GrpcDraftBackend(server.address, timeout_s=2.0, token=token)
        client.open("s", [1, 2], PARAMS)
        assert client.step("s", 0, [2]) == expected_tree("s", 0, [2])
        assert client.server_health().sessions == 1
        client.close("s")
        client.shutdown()
    assert token not in caplog.text


def test_step_bound_crosses_the_wire(fake, server, client):
    """A step's cap on the tree (the adaptive policy's choice) reaches the draft; no cap stays none
    (0 on the wire, what a client from before the field sends)."""
    client.open("s", [1, 2, 3], PARAMS)
    client.step("s", 0, [3], None, TreeBound(nodes=4, depth=3))
    client.step("s", 1, [4], None, TreeBound(nodes=6))
    client.step("s", 2, [5])
    client.step("s", 3, [6], None, TreeBound(ready_only=True))
    client.step("s", 4, [7], None, TreeBound(nodes=5, ready_only=True))
    assert fake.bounds == [TreeBound(4, 3), TreeBound(6, 0), None, TreeBound(0, 0, True), TreeBound(5, 0, True)]


def test_an_open_reports_its_own_seconds_not_its_wait_in_the_draft_s_queue(fake, server):
    """OpenSessionReply.open_s: the draft runs opens one at a time, so of two opens sent together
    the second waits for the first; each reports the seconds it ran itself, which the engine records
    as what an open of that length costs (open_costs.open_seconds; a burst's queueing would overprice
    the next burst's opens, docs/architecture.md "Adaptive speculation", *Deferred open*)."""
    from specextend.open_costs import open_seconds

    fake.open_delay_s = 0.3
    client = GrpcDraftBackend(server.address, timeout_s=2.0, open_timeout_s=5.0)
    try:
        with ThreadPoolExecutor(2) as pool:
            t0 = time.perf_counter()
            futs = [pool.submit(client.open, sid, [1, 2, 3], PARAMS) for sid in ("a", "b")]
            ran = [f.result() for f in futs]
            wall = time.perf_counter() - t0
        assert wall >= 0.6  # (one after the other)
        assert all(isinstance(r, float) and 0.3 <= r < 0.5 for r in ran), ran
        assert 0.3 <= open_seconds(client.open, "c", [4], PARAMS) < 0.5
    finally:
        client.shutdown()


def test_open_seconds_takes_the_draft_s_own_report_where_it_is_sound():
    """open_costs.open_seconds: the open's reported seconds where positive and within the call's
    wall time; else (None, 0: not reported; more than the wall: not sound) the call's wall time."""
    from specextend.open_costs import open_seconds

    def opener(report, sleep_s=0.05):
        def open_fn(*_):
            time.sleep(sleep_s)
            return report
        return open_fn

    assert open_seconds(opener(0.01), "s") == 0.01
    for report in (None, 0.0, 5.0):
        assert 0.05 <= open_seconds(opener(report), "s") < 1.0
