"""The ZeroMQ step channel's client sockets over their life (rpc/zmq_client.py): a socket whose
draft went away, and clients dropped without shutdown, never stall libzmq's I/O thread that every
step channel of the process shares (docs/architecture.md, "Wire protocol")."""

from __future__ import annotations

import time

import grpc
import pytest
import zmq

from specextend.rpc import DraftServerThread, GrpcDraftBackend
from specextend.rpc.zmq_client import StepChannelClient, StepFailed, _Socket
from test_rpc import PARAMS, expected_tree
from test_rpc_zmq import request_bytes


def test_an_idle_socket_of_a_gone_draft_stops_trying(fake):
    """A socket whose draft went away is sent one event and no more (it never reconnects): libzmq
    sends monitor events with a blocking send, so a socket retrying every 100 ms while idle in the
    pool, its monitor unread, filled the monitor's pipe and then blocked the I/O thread that every
    step channel of the process shares (the CI failure of 2026-11-23). Calls after the draft went
    fail at once as UNAVAILABLE, on the idle socket and on a new one (refused), not at a deadline."""
    server = DraftServerThread(fake)
    client = StepChannelClient(server.step_endpoint)
    client.warm()
    watched = _Socket(zmq.Context.instance(), server.step_endpoint)
    for sock in (client._idle[0], watched):
        poller = zmq.Poller()
        poller.register(sock.sock, zmq.POLLOUT)
        assert poller.poll(2000), "a socket did not connect"
    server.stop()
    time.sleep(1.0)  # ten reconnection intervals, had they kept trying
    events = 0
    while watched.monitor.poll(0):
        watched.monitor.recv_multipart()
        events += 1
    assert events == 1  # DISCONNECTED, then nothing
    watched.close()
    for attempt in ("the idle socket", "a new socket"):
        t = time.monotonic()
        with pytest.raises(StepFailed) as info:
            client.call(request_bytes("s", 0, [1]), timeout_s=5.0)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, attempt
        assert time.monotonic() - t < 1.0, attempt
    assert not client._idle  # both retired
    client.close()


def test_a_client_dropped_without_shutdown_leaves_the_channels_working(fake):
    """Clients garbage-collected while connected, never shut down, and then their draft going
    away: the next client in the process still connects and steps. (Collected sockets used to
    close in any order; an event for a monitor already closed blocked libzmq's I/O thread shared by
    every socket of the process: every later step channel failed to connect.)"""
    import gc

    for _ in range(5):
        server = DraftServerThread(fake)
        for i in range(6):
            client = GrpcDraftBackend(server.address, timeout_s=2.0)
            client.open(f"dropped-{i}", [1], PARAMS)
            client.step(f"dropped-{i}", 0, [1])
            client._cycle = client  # collected by the cycle collector, in its order
            del client
        gc.collect()
        server.stop()  # DISCONNECTED for any socket still open
        time.sleep(0.2)
    with DraftServerThread(fake) as server:
        client = GrpcDraftBackend(server.address, timeout_s=2.0)
        client.open("s", [1], PARAMS)
        assert client.step("s", 0, [4]) == expected_tree("s", 0, [4])
        assert client.step_endpoint == server.step_endpoint  # over the channel, not a fallback
        client.shutdown()
