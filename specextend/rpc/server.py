"""gRPC server side of the draft: DraftService over a DraftWorker (docs/architecture.md, "Wire
protocol").

Every call becomes a job on the worker's queue (draft/worker.py), which owns the model and every
session: the asyncio loop stays free to accept calls, answer Health and notice deadlines. A call
whose deadline passes while its job waits in the queue is cancelled before it reaches the model;
one already running completes, which is what makes a client's retry of the same step find it
applied (base.py's step contract). An open whose caller gave up is undone once it has run, so no
session outlives a failed OpenSession.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Optional

import grpc

from specextend.draft.base import DraftBackend
from specextend.draft.worker import Close, Job, Open, Step, as_worker
from specextend.rpc.convert import params_from_proto, retrieval_from_proto, tree_to_proto
from specextend.rpc.errors import status_for
from specextend.v1 import draft_pb2 as pb
from specextend.v1 import draft_pb2_grpc

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256 << 20  # OpenSession carries the prompt, ~5 B per token id on the wire
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),  # accept the client's keepalive pings (30 s) ...
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # ... without a GOAWAY
    ("grpc.so_reuseport", 0),  # a port already taken fails start-up instead of being shared
)


_REAPERS: set[asyncio.Task] = set()


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """DraftService over one draft worker (a DraftWorker, or any DraftBackend behind a SerialDraft);
    `model` is the name Health reports."""

    def __init__(self, backend: DraftBackend, model: str = "") -> None:
        self.worker = as_worker(backend)
        self._owns_worker = self.worker is not backend
        self.model = model

    def shutdown(self) -> None:
        """Ends the worker this servicer put in front of a plain backend (a DraftWorker is its
        owner's); jobs already queued still run."""
        if self._owns_worker:
            self.worker.stop()

    async def _run(self, context: grpc.aio.ServicerContext, job: Job):
        fut = self.worker.submit(job)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the caller gave up: drop the job if it has not started
            fut.cancel()
            raise
        except Exception as exc:  # every worker failure leaves as a status code (errors.py)
            code, details = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("draft worker failed")
            await context.abort(code, details)

    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionReply:
        prompt_ids = tuple(request.prompt_ids)  # [L]
        try:
            params = params_from_proto(request.config)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad draft config: {exc}")
        try:
            await self._run(context, Open(request.session_id, prompt_ids, params))
        except asyncio.CancelledError:  # the open may still run: close it after, so nothing leaks
            self.worker.submit(Close(request.session_id))
            raise
        return pb.OpenSessionReply(prompt_tokens=len(prompt_ids))

    async def Step(self, request: pb.StepRequest, context) -> pb.DraftTree:
        job = Step(request.session_id, request.step, tuple(request.accepted_tokens), retrieval_from_proto(request))
        return tree_to_proto(await self._run(context, job))

    async def CloseSession(self, request: pb.CloseSessionRequest, context) -> pb.CloseSessionReply:
        await self._run(context, Close(request.session_id))
        return pb.CloseSessionReply()

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthReply:
        # Answered on the loop, not queued behind a long prefill.
        return pb.HealthReply(ok=self.worker.health(), sessions=self.worker.num_sessions, model=self.model)


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def start_draft_server(
    worker: DraftBackend, host: str = "127.0.0.1", port: int = 0, *, model: str = ""
) -> tuple[grpc.aio.Server, str]:
    """Starts DraftService on host:port (0 = any free port) on the running loop.

    host is both where it binds and what clients dial: on Ray, the node's IP
    (ray.util.get_node_ip_address()), not 0.0.0.0. Returns the started server and its
    "host:port"."""
    servicer = DraftServicer(worker, model)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(_format_address(host, port))  # raises if it cannot bind
    await server.start()
    reaper = asyncio.get_running_loop().create_task(server.wait_for_termination())
    reaper.add_done_callback(lambda _: servicer.shutdown())
    _REAPERS.add(reaper)  # the loop keeps tasks only weakly
    reaper.add_done_callback(_REAPERS.discard)
    return server, _format_address(host, bound)


class DraftServerThread:
    """A draft server on its own event loop in a background thread (tests, CLI, Ray actor).

    Construction blocks until the server listens (or raises what start-up raised)."""

    def __init__(
        self, worker: DraftBackend, host: str = "127.0.0.1", port: int = 0, *, model: str = "",
    ) -> None:
        self._ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._grace_s = 0.0
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(worker, host, port, model),),
            name="draft-grpc-server", daemon=True,
        )
        self._thread.start()
        self.address = self._ready.result()

    async def _serve(self, worker: DraftBackend, host: str, port: int, model: str) -> None:
        try:
            server, address = await start_draft_server(worker, host, port, model=model)
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set_result(address)
        await self._stop.wait()
        await server.stop(self._grace_s)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stops accepting calls, cancels those in flight after grace_s, joins the thread."""
        if self._thread.is_alive():
            self._grace_s = grace_s
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()

    def __enter__(self) -> "DraftServerThread":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
