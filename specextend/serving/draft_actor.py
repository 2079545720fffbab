"""The draft actor: the draft model behind DraftService, on its own GPU (DESIGN 2).

A thin shell: load_model + InProcessDraft + DraftServerThread. Ray is the control plane (start,
address, restart); gRPC is the per-step data plane. After a restart (`max_restarts`) the actor
runs __init__ again and serves on a new port: the target asks `address()` again.
"""

from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger(__name__)


class DraftActor:
    def __init__(self, spec: str, vocab_size: int, dtype: str, device: str, attention_backend: str,
                 prefill_chunk: int = 2048, cuda_graphs: bool = True, pipeline: bool = False,
                 torch_compile: bool = False, full_graphs: bool = True) -> None:
        from specextend.draft.inprocess import InProcessDraft
        from specextend.models.loader import load_model
        from specextend.rpc import DraftServerThread

        # vocab_size: the target's, so a random draft matches it; a random tiny draft is built as
        # the correlated copy of the (deterministic) tiny target by load_model itself.
        self.model = load_model(spec, role="draft", dtype=dtype, device=device,
                                attention_backend=attention_backend,
                                vocab_size=vocab_size, cuda_graphs=cuda_graphs,
                                torch_compile=torch_compile, full_graphs=full_graphs)
        self.backend = InProcessDraft(self.model.decoder, name=self.model.name, prefill_chunk=prefill_chunk)
        host = ray.util.get_node_ip_address()
        self.server = DraftServerThread(self.backend, host=host, port=0, model=self.model.name,
                                        pipeline=pipeline)
        log.info("draft %s serving on %s (pid %d, CUDA_VISIBLE_DEVICES=%s)", self.model.name,
                 self.server.address, os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"))

    def address(self) -> str:
        """"host:port" of this instance's DraftService."""
        return self.server.address

    def info(self) -> dict:
        return {"model": self.model.name, "address": self.server.address, "pid": os.getpid(),
                "sessions": self.backend.num_sessions,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def __ray_shutdown__(self) -> None:
        self.server.stop()
