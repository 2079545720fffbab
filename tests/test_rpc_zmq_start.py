"""DraftBackend.start_step over the ZeroMQ step channel (docs/architecture.md, "Overlapped drafting",
early asks): a real server on 127.0.0.1, the request sent on the caller's thread over an idle
connection, its reply in a future; retried as a step's; None where nothing can begin at once."""

from __future__ import annotations

import pytest

from specextend.draft.base import DraftError
from specextend.rpc import DraftServerThread, GrpcDraftBackend
from test_rpc import PARAMS, expected_tree


def test_a_started_step_is_sent_at_once_and_answered_in_a_future(fake, channel_steps):
    """GrpcDraftBackend.start_step: sent on the caller's thread over an idle connection, answered in a
    future by the client's waiter (the same tree as `step`, with its times); None, nothing sent,
    where no connection is idle, so the caller calls `step`."""
    with DraftServerThread(fake) as server:
        client = GrpcDraftBackend(server.address)
        client.open("s", [1, 2, 3], PARAMS)  # (it connects a socket ahead: maybe connected by now, maybe not)
        first = client.start_step("s", 0, [3])
        tree = client.step("s", 0, [3]) if first is None else first.result(5)
        assert tree == expected_tree("s", 0, [3])
        with client._steps._lock:  # no idle connection: nothing begins, nothing is sent
            idle, client._steps._idle = client._steps._idle, []
        assert client.start_step("s", 1, [4, 5]) is None and channel_steps["s"] == [0]
        for sock in idle:
            sock.close()
        assert client.step("s", 0, [3]) == tree  # (a retry of step 0, on a new connection, now idle)
        fut = client.start_step("s", 1, [4, 5])
        assert fut is not None
        assert fut.result(5) == expected_tree("s", 1, [4, 5])
        assert fut.submitted <= fut.started <= fut.ended
        assert channel_steps["s"] == [0, 0, 1]
        # a retried step number: the same tree again (the server applies it once)
        assert client.start_step("s", 1, [4, 5]).result(5) == expected_tree("s", 1, [4, 5])
        client.close("s")
        client.shutdown()
        assert client.start_step("s", 2, [6]) is None  # shut down: nothing begins


def test_a_started_step_that_fails_raises_from_its_future(fake):
    with DraftServerThread(fake) as server:
        client = GrpcDraftBackend(server.address)
        client.open("s", [1, 2, 3], PARAMS)
        client.step("s", 0, [3])
        fut = client.start_step("nope", 0, [3])  # an unknown session: the server's error, as step's
        with pytest.raises(DraftError):
            fut.result(5)
        client.shutdown()


def test_a_started_step_past_its_deadline_is_sent_once_more(fake):
    """A started step whose first attempt runs past the deadline is retried as `step` retries (the
    same step number: the draft applies it once and answers the retry with the same tree)."""
    with DraftServerThread(fake) as server:
        client = GrpcDraftBackend(server.address, timeout_s=1.0)
        client.open("s", [1, 2, 3], PARAMS)
        client.step("s", 0, [3])
        fake.slow_once[1] = 1.3  # past the first attempt's second, well within the retry's
        fut = client.start_step("s", 1, [4])
        assert fut.result(5) == expected_tree("s", 1, [4])
        assert [step for _, step, _ in fake.applied] == [0, 1]  # applied once
        client.shutdown()
