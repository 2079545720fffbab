"""Application settings: the one validated boundary between Serve arguments / YAML and the engine.

Names are DESIGN.md's configuration names. `serve run deploy.app:specextend key=value ...` passes
strings; pydantic's lax mode coerces them ("0" -> 0). Unknown names and out-of-range values raise
pydantic.ValidationError naming the field, before anything is deployed.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specextend.config import EngineConfig, RetrievalConfig, TreeConfig

DEFAULT_PREFILL_WINDOW = 512  # DESIGN 3.4: the reference's draft prefill window in specextend mode
# Logical CPUs reserved per model actor (target replica, draft actor) and by the ingress: the whole
# app fits a 2-core machine (DESIGN 5); they are reservations for scheduling, not limits.
MODEL_CPUS = 0.5
INGRESS_CPUS = 0.25


def _default_num_gpus() -> float:
    try:
        import torch

        return 1.0 if torch.cuda.is_available() else 0.0
    except Exception:  # noqa: BLE001 - no torch / broken CUDA: run on CPU
        return 0.0


class AppSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field("default", min_length=1)  # model spec: folder, .gguf, hub id, default, random:<preset>
    draft: str = Field("default", min_length=1)
    mode: Literal["ar", "sd", "specextend"] = "specextend"
    tree_nodes: int = Field(TreeConfig.nodes, ge=1, le=1024)
    tree_depth: int = Field(TreeConfig.depth, ge=1, le=64)
    tree_topk: int = Field(TreeConfig.topk, ge=1, le=64)
    retrieval_chunk_size: int = Field(RetrievalConfig.chunk_size, ge=1, le=65536)
    retrieval_top_k: int = Field(RetrievalConfig.top_k, ge=1)
    retrieval_every: int = Field(RetrievalConfig.every, ge=1)
    retrieval_sink_chunks: int = Field(RetrievalConfig.sink_chunks, ge=0)
    retrieval_recent_chunks: int = Field(RetrievalConfig.recent_chunks, ge=0)
    # None: 512 in specextend mode (the reference), 0 (full attention) otherwise
    draft_prefill_window: Optional[int] = Field(None, ge=0)
    prefill_chunk: int = Field(EngineConfig.prefill_chunk, ge=16)  # prompt tokens per prefill forward
    attention_backend: Literal["auto", "flash", "torch", "eager"] = "auto"
    cuda_graphs: bool = True  # decode-time forwards as piecewise CUDA graphs (CUDA only)
    full_graphs: bool = True  # one CUDA graph per forward (Triton prefix kernel); false: piecewise graphs
    torch_compile: bool = False  # the graphs' segments fused by Inductor (compiled during warm-up)
    # pipelined drafting (DESIGN 4): the draft actor drafts the next tree, guessing the outcome,
    # while the target verifies; lossless either way, measured on CPU only so far: off by default
    draft_pipeline: bool = False
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = "auto"
    num_gpus: float = Field(default_factory=_default_num_gpus, ge=0, le=8)  # per model (target, draft)
    max_prompt_tokens: Optional[int] = Field(None, ge=1)  # None: the target's context length
    max_new_tokens: int = Field(4096, ge=1)
    max_concurrent_sessions: int = Field(16, ge=1, le=4096)  # per replica
    max_queued_requests: int = Field(64, ge=0, le=65536)  # per replica, beyond the sessions; then 429
    served_model_name: Optional[str] = Field(None, min_length=1)  # None: the target's name
    draft_timeout_s: float = Field(10.0, gt=0, le=3600)  # deadline of one draft Step RPC
    # KV-cache budget for admission control; None: 90% of free GPU memory after warm-up (CUDA),
    # a quarter of the host's memory (CPU)
    kv_cache_memory_gb: Optional[float] = Field(None, gt=0)
    # benchmarks only (DESIGN 3.5): force every step to accept this many draft tokens; responses
    # then say `replayed: true` and are NOT the model's output
    replay_accept_length: Optional[int] = Field(None, ge=0, le=64)

    @model_validator(mode="after")
    def _check_engine_config(self) -> "AppSettings":
        if self.num_gpus > 1 and not float(self.num_gpus).is_integer():
            raise ValueError("num_gpus above 1 must be a whole number")
        self.to_engine_config()  # the frozen dataclasses' own cross-field checks (ValueError)
        return self

    def to_engine_config(self) -> EngineConfig:
        specextend = self.mode == "specextend"
        window = self.draft_prefill_window
        if window is None:
            window = DEFAULT_PREFILL_WINDOW if specextend else 0
        retrieval = RetrievalConfig(
            enabled=specextend, chunk_size=self.retrieval_chunk_size, top_k=self.retrieval_top_k,
            every=self.retrieval_every, sink_chunks=self.retrieval_sink_chunks,
            recent_chunks=self.retrieval_recent_chunks, draft_prefill_window=window)
        tree = TreeConfig(nodes=self.tree_nodes, depth=self.tree_depth, topk=self.tree_topk)
        return EngineConfig(
            target=self.target, draft=self.draft, mode=self.mode, tree=tree, retrieval=retrieval,
            attention_backend=self.attention_backend, cuda_graphs=self.cuda_graphs,
            torch_compile=self.torch_compile, full_graphs=self.full_graphs, dtype=self.dtype, prefill_chunk=self.prefill_chunk,
            device="cuda" if self.num_gpus > 0 else "cpu",
            max_prompt_tokens=self.max_prompt_tokens, max_new_tokens=self.max_new_tokens,
            max_concurrent_sessions=self.max_concurrent_sessions,
        ).with_mode_defaults()

    @property
    def uses_draft(self) -> bool:
        return self.mode != "ar"

    @property
    def gpus_per_replica(self) -> float:
        return self.num_gpus * (2 if self.uses_draft else 1)


class InsufficientGPUsError(RuntimeError):
    """The cluster cannot ever place one replica's GPUs (fail fast instead of pending forever)."""


def check_gpus(settings: AppSettings, node_gpus: list[float], autoscaler_max_gpus: Optional[float]) -> None:
    """Raises InsufficientGPUsError unless one node (STRICT_PACK) has the GPUs of a replica.

    node_gpus: GPUs of each alive node; autoscaler_max_gpus: the most GPUs the autoscaler's node
    groups can add (None: no autoscaler), in which case the replica may wait for a new node."""
    need = settings.gpus_per_replica
    if need <= 0 or any(g >= need for g in node_gpus):
        return
    if autoscaler_max_gpus is not None and autoscaler_max_gpus >= need:
        return
    what = "target + draft" if settings.uses_draft else "target"
    have = max(node_gpus, default=0)
    raise InsufficientGPUsError(
        f"num_gpus={settings.num_gpus:g} needs {need:g} GPU(s) on one node "
        f"per replica ({what}), but the Ray cluster's largest node has {have:g} "
        f"(total {sum(node_gpus):g}); replicas would stay pending forever. "
        f"Pass num_gpus=0 to run on CPU, or add GPU nodes.")


def check_cluster_gpus(settings: AppSettings) -> None:
    """check_gpus against the connected Ray cluster (alive nodes + autoscaler node groups)."""
    import ray

    if settings.gpus_per_replica <= 0:
        return
    node_gpus = [float(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    autoscaler = None
    try:
        from ray._private.state import state  # the same source Ray Train and Ray Data use

        limits = state.get_max_resources_from_cluster_config()
        if limits is not None:
            autoscaler = float(limits.get("GPU", 0))
    except Exception:  # noqa: BLE001 - no autoscaler information: judge by the nodes alone
        pass
    check_gpus(settings, node_gpus, autoscaler)
