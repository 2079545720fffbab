"""The draft actor: the draft model behind DraftService, on its own GPU (docs/architecture.md,
"Deployment").

A thin shell: load_pair + DraftWorker + DraftServerThread, built from the engine configuration. Ray is the control plane (start,
address, restart); gRPC carries sessions' opening, closing and health, and the ZeroMQ step channel
(with step_transport=zmq, the replica's setting) each step, gRPC's StepStream without it. After
a restart (`max_restarts`) the actor runs __init__ again and serves on new ports: the target asks
`address()` again, and Health where the step channel is.

Both listen on loopback only and accept only requests carrying the token its replica made
(rpc/auth.py): the replica and this actor are one STRICT_PACK placement group, so always on one
node, and nothing else on the node or the network can open or step sessions.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Optional

from specextend.config import EngineConfig
from specextend.models import late_work

if TYPE_CHECKING:
    from specextend.serving.settings import AppSettings

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"  # the target is on this node (STRICT_PACK): the narrowest address that works


def draft_client(settings: AppSettings, address: str, token: str):
    """The replica's client of its draft actor at `address`: deadlines and step transport as the
    settings say (step_transport=zmq: the ZeroMQ step channel the actor advertises; grpc: StepStream)."""
    from specextend.rpc import GrpcDraftBackend

    return GrpcDraftBackend(address, timeout_s=settings.draft_timeout_s, token=token,
                            transport=settings.step_transport)


class DraftActor:
    def __init__(self, config: EngineConfig, token: str, step_transport: str = "zmq",
                 switch_interval_ms: Optional[float] = None) -> None:
        from specextend.builder import draft_worker, load_pair
        from specextend.rpc import DraftServerThread

        t0 = time.time()  # wall clock: the replica that created this actor compares it with its own
        # checks the pair (tokenizers, vocabularies) before loading the draft's weights; a random
        # tiny draft is built as the correlated copy of the (deterministic) tiny target
        _, self.model = load_pair(config, roles=("draft",), light=("target", "draft"))  # (no transformers: light_meta.py)
        t1 = time.time()
        if switch_interval_ms is not None:  # (the worker lowers it to its own with overlap only where unset)
            sys.setswitchinterval(switch_interval_ms / 1e3)
        self.backend = draft_worker(config, self.model, beside_target=False)  # (warmed up; alone on its GPU)
        t2 = time.time()
        self.server = DraftServerThread(self.backend, host=LOOPBACK, port=0, model=self.model.name, token=token,
                                        step_channel="ipc" if step_transport == "zmq" else None)
        # where this start's time went (the replica reports it in /metrics, docs/architecture.md, "Models")
        self.startup = dict(started_at=t0, load_s=t1 - t0, warm_up_s=t2 - t1, serve_s=time.time() - t2)
        log.info("draft %s serving on %s, steps on %s (pid %d, CUDA_VISIBLE_DEVICES=%s, overlap %s)",
                 self.model.name, self.server.address, self.server.step_endpoint or "gRPC only", os.getpid(),
                 os.environ.get("CUDA_VISIBLE_DEVICES"), config.overlap)

    def warmed(self) -> None:
        """The replica's warm-up (whose requests reach this draft too) is over: captures and kernel
        compiles from now on are logged as late (models/late_work.py)."""
        late_work.mark_ready()

    def address(self) -> str:
        """"host:port" of this instance's DraftService."""
        return self.server.address

    def info(self) -> dict:
        return {"model": self.model.name, "address": self.server.address,
                "step_endpoint": self.server.step_endpoint, "pid": os.getpid(),
                "sessions": self.backend.num_sessions, "startup": self.startup,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def __ray_shutdown__(self) -> None:
        self.server.stop()
