"""gRPC server side of the draft: DraftService over a DraftWorker (docs/architecture.md, "Wire
protocol").

A synchronous gRPC server: each call is handled on one of gRPC's pool threads, which submits a
job to the worker's queue (draft/worker.py, which owns the model and every session) and waits for
its future; a StepStream holds one pool thread for its session's life and submits one job per
request (its numbers: benchmarks/rpc_roundtrip.py, docs/architecture.md, "Wire protocol").
A call whose deadline passes, or whose client gives up, while its job waits in the queue has the
job cancelled before it reaches the model; one already running completes, which is what makes a
client's retry of the same step find it applied (base.py's step contract). An open whose caller
gave up is undone once it has run, so no session outlives a failed OpenSession.
With a token, every call must carry it (rpc/auth.py); the served app always sets one.

DraftServerThread also serves the same steps over ZeroMQ (zmq_server.py, the per-step data plane)
on the same worker, and advertises where in OpenSessionReply and HealthReply (`step_endpoint`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Iterator, Literal, Optional, Union

import grpc

from specextend.draft.base import DraftBackend, DraftTree
from specextend.draft.jobs import with_times
from specextend.draft.worker import Close, Job, Open, Prepare, Step, as_worker
from specextend.rpc.auth import TokenInterceptor
from specextend.rpc.convert import bound_from_proto, params_from_proto, retrieval_from_proto, tree_to_proto
from specextend.rpc.errors import status_for
from specextend.v1 import draft_pb2 as pb
from specextend.v1 import draft_pb2_grpc

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256 << 20  # OpenSession carries the prompt, ~5 B per token id on the wire
# calls in flight at once, each on a thread waiting for its job; a StepStream holds its thread for
# its session's life, so room for the most sessions a replica may run (config.py's
# max_concurrent_sessions, at most 4096) besides the unary calls (threads start when first needed)
SERVER_THREADS = 4096 + 64
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),  # accept the client's keepalive pings (30 s) ...
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # ... without a GOAWAY
    ("grpc.so_reuseport", 0),  # a port already taken fails start-up instead of being shared
)


def step_from_proto(request: pb.StepRequest) -> Union[Step, Prepare]:
    """The worker's job for a StepRequest (unary Step, one message of StepStream, or the step
    channel's, where it may be a prepare)."""
    if request.prepare:
        return Prepare(request.session_id, request.step, tuple(request.accepted_tokens), retrieval_from_proto(request),
                       request.prepare_due_us / 1e6)
    return Step(request.session_id, request.step, tuple(request.accepted_tokens), retrieval_from_proto(request),
                bound_from_proto(request))


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """DraftService over one draft worker (a DraftWorker, or any DraftBackend behind a SerialDraft);
    `model` is the name Health reports."""

    def __init__(self, backend: DraftBackend, model: str = "", step_endpoint: str = "") -> None:
        self.worker = as_worker(backend)
        self._owns_worker = self.worker is not backend
        self.model = model
        self.step_endpoint = step_endpoint  # the ZeroMQ step channel's, advertised; "": none
        self.executor = concurrent.futures.ThreadPoolExecutor(SERVER_THREADS, thread_name_prefix="draft-rpc")

    def shutdown(self) -> None:
        """After the server stopped: ends its threads and the worker this servicer put in front of a
        plain backend (a DraftWorker is its owner's); jobs already queued still run."""
        self.executor.shutdown(wait=False)
        if self._owns_worker:
            self.worker.stop()

    def _run(self, context: grpc.ServicerContext, job: Job):
        return self._await(context, self.worker.submit(job))

    def _await(self, context: grpc.ServicerContext, fut: concurrent.futures.Future):
        context.add_callback(fut.cancel)  # the RPC ended (deadline, client gone): drop it if queued
        return self._result(context, fut, context.time_remaining())

    def _result(self, context: grpc.ServicerContext, fut: concurrent.futures.Future, timeout: Optional[float]):
        """The job's result, or the call aborted with the status its failure maps to (errors.py)."""
        try:
            result = fut.result(timeout=timeout)
            return with_times(result, fut) if isinstance(result, DraftTree) else result
        except concurrent.futures.TimeoutError:
            fut.cancel()
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the draft did not answer in time")
        except concurrent.futures.CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, "the call ended before the draft ran it")
        except Exception as exc:  # every worker failure leaves as a status code (errors.py)
            code, details = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("draft worker failed")
            context.abort(code, details)

    def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionReply:
        prompt_ids = tuple(request.prompt_ids)  # [L]
        try:
            params = params_from_proto(request.config)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad draft config: {exc}")
        opened = False
        try:
            fut = self.worker.submit(Open(request.session_id, prompt_ids, params))
            self._await(context, fut)
            opened = context.is_active()
            return pb.OpenSessionReply(prompt_tokens=len(prompt_ids), step_endpoint=self.step_endpoint,
                                       prepares=bool(self.step_endpoint) and self.worker.supports_prepare,
                                       open_s=getattr(fut, "ran_s", 0.0))  # (jobs.JobWorker._answer)
        finally:
            if not opened:  # the caller gave up: close after the open (queued or run), nothing leaks
                self.worker.submit(Close(request.session_id))

    def Step(self, request: pb.StepRequest, context) -> pb.DraftTree:
        return tree_to_proto(self._run(context, self._step_job(request, context)))

    @staticmethod
    def _step_job(request: pb.StepRequest, context) -> Step:
        if request.prepare:  # its answer is Outcomes, not a DraftTree: the step channel's alone
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a prepare goes over the step channel (ZeroMQ)")
        return step_from_proto(request)

    def StepStream(self, requests, context) -> Iterator[pb.DraftTree]:
        """One session's steps over one call (docs/architecture.md, "Wire protocol"): each request is
        answered in order, within its own timeout_ms; a failure ends the stream with Step's status.
        When the call ends (client gone, cancelled), the step still queued is dropped."""
        in_flight: list[concurrent.futures.Future] = []
        context.add_callback(lambda: in_flight and in_flight[0].cancel())
        for request in requests:
            fut = self.worker.submit(self._step_job(request, context))
            in_flight[:] = (fut,)
            yield tree_to_proto(self._result(context, fut, request.timeout_ms / 1e3 if request.timeout_ms else None))

    def CloseSession(self, request: pb.CloseSessionRequest, context) -> pb.CloseSessionReply:
        self._run(context, Close(request.session_id))
        return pb.CloseSessionReply()

    def Health(self, request: pb.HealthRequest, context) -> pb.HealthReply:
        # answered on the calling thread, not queued behind a long prefill
        return pb.HealthReply(ok=self.worker.health(), sessions=self.worker.num_sessions, model=self.model,
                              step_endpoint=self.step_endpoint)


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def start_draft_server(worker: DraftBackend, host: str = "127.0.0.1", port: int = 0, *, model: str = "",
                       token: Optional[str] = None) -> tuple[grpc.Server, DraftServicer, str]:
    """Starts DraftService on host:port (0 = any free port). host is both where it binds and what
    clients dial; on Ray the draft actor shares its node with the target, so loopback. With a
    `token`, a call without `authorization: Bearer <token>` is UNAUTHENTICATED (rpc/auth.py).
    Returns the started server, its servicer and its "host:port". (DraftServerThread adds the
    ZeroMQ step channel.)"""
    servicer = DraftServicer(worker, model)
    interceptors = (TokenInterceptor(token),) if token is not None else ()
    server = grpc.server(servicer.executor, interceptors=interceptors, options=SERVER_OPTIONS)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(_format_address(host, port))  # raises if it cannot bind
    except RuntimeError:
        servicer.shutdown()
        raise
    server.start()
    return server, servicer, _format_address(host, bound)


def _start_channel(worker, host: str, token: Optional[str], ipc: bool):
    from specextend.rpc.zmq_server import StepChannel  # imports this module (step_from_proto)

    if ipc:
        try:
            return StepChannel(worker, host, token=token, ipc=True)
        except Exception as exc:  # noqa: BLE001 - e.g. no Unix sockets, or a temp path too long for one
            logger.warning("the draft's step channel cannot use a Unix socket (%s): loopback TCP instead", exc)
    return StepChannel(worker, host, token=token)


class DraftServerThread:
    """A running draft server (tests, CLI, Ray actor): DraftService on gRPC's own threads and the
    ZeroMQ step channel on a thread of its own, both over one worker and behind one token.
    `step_channel`: "ipc" (the default) binds the channel on a Unix socket in a private directory
    (only this user reaches it; about 40 us a step faster than loopback TCP on the 2-core host), or
    on a free TCP port of `host` where that fails; "tcp" on `host` only; None serves no channel.
    `step_endpoint` is the channel's ("" without one).

    Construction returns once both listen (or raises what start-up raised)."""

    def __init__(self, worker: DraftBackend, host: str = "127.0.0.1", port: int = 0, *, model: str = "",
                 token: Optional[str] = None, step_channel: Optional[Literal["ipc", "tcp"]] = "ipc") -> None:
        self._server, self._servicer, self.address = start_draft_server(worker, host, port, model=model,
                                                                        token=token)
        self._channel = None
        if step_channel is not None:
            try:
                self._channel = _start_channel(self._servicer.worker, host, token, step_channel == "ipc")
            except BaseException:
                self._server.stop(0).wait()
                self._servicer.shutdown()
                raise
            self._servicer.step_endpoint = self._channel.endpoint
        self.step_endpoint = self._servicer.step_endpoint
        self._stopped: Optional[bool] = None

    def stop(self, grace_s: float = 0.0) -> None:
        """Stops accepting calls, cancels those in flight after grace_s (the ZeroMQ channel's at
        once, answered UNAVAILABLE), and waits for that."""
        if not self._stopped:
            self._stopped = True
            if self._channel is not None:
                self._channel.stop()
            self._server.stop(grace_s).wait()
            self._servicer.shutdown()

    def __enter__(self) -> "DraftServerThread":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
