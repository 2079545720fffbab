"""Frozen configuration objects, one per component.

Names follow DESIGN.md's configuration section; the CLI uses the same names with dashes and the
serving layer validates the same names with pydantic (specextend.serving.settings).

Glossary of dimension letters used in shape comments across the package:
    T  new tokens (queries) in one forward        L  committed prefix length (keys in the cache)
    S  key slots considered by one attention call  N  draft tree nodes (root excluded)
    H  query heads   G  KV heads   D  head dim   E  hidden size   V  vocabulary size
    C  retrieval chunk size   K  chunks kept (retrieval budget)   W  draft working-cache length
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

MODES = ("ar", "sd", "specextend")
ATTENTION_BACKENDS = ("auto", "flash", "torch", "eager")
DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the dynamic draft tree (DESIGN 3.1)."""

    nodes: int = 16  # best nodes returned (root excluded)
    depth: int = 6  # maximum depth
    topk: int = 4  # branching: children per expanded node and frontier width

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.depth < 1 or self.topk < 1:
            raise ValueError("tree_nodes, tree_depth and tree_topk must all be >= 1")


@dataclass(frozen=True)
class RetrievalConfig:
    """Cross-model retrieval (DESIGN 3.4). `enabled=False` keeps the full draft cache."""

    enabled: bool = False
    chunk_size: int = 32
    top_k: int = 32
    every: int = 4
    sink_chunks: int = 1
    recent_chunks: int = 1
    draft_prefill_window: int = 0  # 0 = full attention during draft prefill

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.top_k < 1 or self.every < 1:
            raise ValueError("retrieval_chunk_size, retrieval_top_k, retrieval_every must be >= 1")
        if self.sink_chunks < 0 or self.recent_chunks < 0:
            raise ValueError("retrieval_sink_chunks and retrieval_recent_chunks must be >= 0")
        if self.sink_chunks + self.recent_chunks > self.top_k:
            raise ValueError("retrieval_sink_chunks + retrieval_recent_chunks must fit retrieval_top_k")
        if self.draft_prefill_window < 0:
            raise ValueError("draft_prefill_window must be >= 0")

    @property
    def budget_tokens(self) -> int:
        return self.chunk_size * self.top_k


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (target + draft pair) is built from."""

    target: str = "default"
    draft: str = "default"
    mode: str = "sd"
    tree: TreeConfig = field(default_factory=TreeConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    hybrid_attention: bool = False  # HTA verification (prefix kernel + tree mask, LSE merge)
    attention_backend: str = "auto"
    cuda_graphs: bool = True  # decode-time forwards as piecewise CUDA graphs (CUDA only)
    full_graphs: bool = True  # one graph per forward, prefix attention in Triton (needs Triton; else piecewise)
    torch_compile: bool = False  # the graphs' segments fused by torch.compile/Inductor (CUDA graphs only)
    dtype: str = "auto"
    device: str = "auto"
    prefill_chunk: int = 2048  # chunked prefill: queries per forward
    max_prompt_tokens: Optional[int] = None  # None: the target's context length
    max_new_tokens: int = 4096
    max_concurrent_sessions: int = 16

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.prefill_chunk < 1 or self.max_new_tokens < 1 or self.max_concurrent_sessions < 1:
            raise ValueError("prefill_chunk, max_new_tokens, max_concurrent_sessions must be >= 1")

    def with_mode_defaults(self) -> "EngineConfig":
        """`specextend` mode switches HTA and retrieval on (with the reference's prefill window)."""
        if self.mode != "specextend":
            return self
        retrieval = self.retrieval
        if not retrieval.enabled:
            retrieval = replace(retrieval, enabled=True, draft_prefill_window=512)
        return replace(self, hybrid_attention=True, retrieval=retrieval)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 = greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
