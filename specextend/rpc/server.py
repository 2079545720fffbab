"""gRPC server side of the draft: DraftService over any DraftBackend (DESIGN.md sections 2 and 4).

The backend's model work is synchronous torch code: every backend call runs in one worker thread
per servicer, so calls are serialized (the backend needs no locking) and the asyncio loop stays
free to accept calls, answer Health and notice deadlines. A call whose deadline passes while it
waits in the queue is dropped before it reaches the backend; one already running completes, which
is what makes a client's retry of the same step find it applied (base.py's step contract). An
open whose caller gave up is undone once it has run, so no session outlives a failed OpenSession.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from typing import Callable, Optional, TypeVar

import grpc

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftBackend, DraftSessionParams, DraftTree, Retrieval
from specextend.rpc.errors import status_for
from specextend.v1 import draft_pb2 as pb
from specextend.v1 import draft_pb2_grpc

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_REQUEST_BYTES = 256 << 20  # OpenSession carries the prompt, ~5 B per token id on the wire
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),  # accept the client's keepalive pings (30 s) ...
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # ... without a GOAWAY
    ("grpc.so_reuseport", 0),  # a port already taken fails start-up instead of being shared
)


def params_from_proto(config: pb.DraftConfig) -> DraftSessionParams:
    """Validates as the frozen configs do: a bad value raises ValueError -> INVALID_ARGUMENT."""
    return DraftSessionParams(
        tree=TreeConfig(nodes=config.tree_nodes, depth=config.tree_depth, topk=config.tree_topk),
        retrieval=RetrievalConfig(
            enabled=config.retrieval_enabled,
            chunk_size=config.retrieval_chunk_size,
            top_k=config.retrieval_top_k,
            every=config.retrieval_every,
            sink_chunks=config.retrieval_sink_chunks,
            recent_chunks=config.retrieval_recent_chunks,
            draft_prefill_window=config.draft_prefill_window,
        ),
        max_new_tokens=config.max_new_tokens,
    )


def tree_to_proto(tree: DraftTree) -> pb.DraftTree:
    return pb.DraftTree(
        step=tree.step, tokens=tree.tokens, parents=tree.parents,
        draft_cache_tokens=tree.draft_cache_tokens, pipelined=tree.pipelined,
    )


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """DraftService over one DraftBackend; `model` is the name Health reports."""

    def __init__(self, backend: DraftBackend, model: str = "", pipeline: bool = False) -> None:
        self.backend = backend
        self.model = model
        # pipelined drafting (DESIGN 4): after answering a step, draft the next one on the idle
        # worker while the target verifies; backends without speculate() ignore it
        self.pipeline = pipeline and hasattr(backend, "speculate")
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="draft-rpc")
        self._sessions: set[str] = set()  # opened, not closed; written by the worker only

    async def _run(self, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)
        except Exception as exc:  # every backend failure leaves as a status code (errors.py)
            code, details = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("draft backend failed")
            await context.abort(code, details)

    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionReply:
        prompt_ids = tuple(request.prompt_ids)  # [L]

        def open_session() -> None:
            self.backend.open(request.session_id, prompt_ids, params_from_proto(request.config))
            self._sessions.add(request.session_id)

        self._announce(None)
        try:
            await self._run(context, open_session)
        except asyncio.CancelledError:  # the caller gave up (deadline, cancel): it has no session
            with contextlib.suppress(RuntimeError):  # RuntimeError: the server is shutting down
                self._executor.submit(self._close, request.session_id)  # runs after the open
            raise
        return pb.OpenSessionReply(prompt_tokens=len(prompt_ids))

    async def Step(self, request: pb.StepRequest, context) -> pb.DraftTree:
        retrieval: Optional[Retrieval] = None
        if request.HasField("retrieval"):
            retrieval = Retrieval(tuple(request.retrieval.chunk_ids), request.retrieval.chunk_size)
        accepted = tuple(request.accepted_tokens)
        self._announce(request.session_id, accepted)
        tree = await self._run(
            context,
            lambda: self.backend.step(request.session_id, request.step, accepted, retrieval),
        )
        if self.pipeline:
            seen = self.backend.requests_seen
            with contextlib.suppress(RuntimeError):  # RuntimeError: the server is shutting down
                self._executor.submit(self._speculate, request.session_id, seen)
        return tree_to_proto(tree)

    def _announce(self, session_id: Optional[str], accepted: tuple = ()) -> None:
        """A request is queued for the worker: stop a speculation that cannot serve it."""
        if self.pipeline:
            self.backend.interrupt(session_id, accepted)

    def _speculate(self, session_id: str, seen: int) -> None:  # on the worker
        try:
            self.backend.speculate(session_id, seen)
        except Exception:  # a failed guess costs nothing but time: the next step rolls it back
            logger.exception("draft speculation failed")

    async def CloseSession(self, request: pb.CloseSessionRequest, context) -> pb.CloseSessionReply:
        self._announce(None)
        await self._run(context, lambda: self._close(request.session_id))
        return pb.CloseSessionReply()

    def _close(self, session_id: str) -> None:  # on the worker
        self.backend.close(session_id)
        self._sessions.discard(session_id)

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthReply:
        # Answered on the loop, not queued behind a long prefill: backend.health() must be cheap.
        return pb.HealthReply(
            ok=self.backend.health(), sessions=len(self._sessions), model=self.model
        )

    def shutdown(self) -> None:
        """Drops queued calls; a backend call already running finishes in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)


_REAPERS: set[asyncio.Task] = set()


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def start_draft_server(
    backend: DraftBackend, host: str = "127.0.0.1", port: int = 0, *, model: str = "", pipeline: bool = False
) -> tuple[grpc.aio.Server, str]:
    """Starts DraftService on host:port (0 = any free port) on the running loop.

    host is both where it binds and what clients dial: on Ray, the node's IP
    (ray.util.get_node_ip_address()), not 0.0.0.0. Returns the started server and its
    "host:port". Stopping the server (`await server.stop(grace)`) also ends the worker thread."""
    servicer = DraftServicer(backend, model, pipeline)
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
        self, backend: DraftBackend, host: str = "127.0.0.1", port: int = 0, *, model: str = "",
        pipeline: bool = False,
    ) -> None:
        self._ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._grace_s = 0.0
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(backend, host, port, model, pipeline),),
            name="draft-grpc-server", daemon=True,
        )
        self._thread.start()
        self.address = self._ready.result()

    async def _serve(self, backend: DraftBackend, host: str, port: int, model: str, pipeline: bool) -> None:
        try:
            server, address = await start_draft_server(backend, host, port, model=model, pipeline=pipeline)
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
