"""The configuration tree: the one schema of every setting (docs/architecture.md, "Configuration").

Frozen pydantic dataclasses, validated wherever they are built. The flat names that the CLI flags,
the Serve arguments, YAML and the draft's wire config use are derived from these fields
(specextend.schema): a nested field's flat name is its parent's prefix plus its own name, or the
`flat` name its metadata gives. Nothing else declares a setting, its type, range or default.

Settings whose default depends on the mode are `None` ("by mode") until `EngineConfig` resolves
them, once, in `__post_init__`: HTA is on in `specextend` and `lookup` modes, retrieval in
`specextend` mode, both off otherwise, and
the draft's prefill window is 512 tokens with retrieval (the reference's), else full attention.

Glossary of dimension letters used in shape comments across the package:
    T  new tokens (queries) in one forward        L  committed prefix length (keys in the cache)
    S  key slots considered by one attention call  N  draft tree nodes (root excluded)
    H  query heads   G  KV heads   D  head dim   E  hidden size   V  vocabulary size
    C  retrieval chunk size   K  chunks kept (retrieval budget)   W  draft working-cache length
    P  overlap pool nodes (draft side)
"""

from __future__ import annotations

from dataclasses import dataclass as _std_dataclass
from dataclasses import replace
from typing import Annotated, Any, Literal, Optional

from pydantic import BeforeValidator, ConfigDict, Field, SecretStr
from pydantic.dataclasses import dataclass

MODES = ("ar", "lookup", "sd", "specextend")
ATTENTION_BACKENDS = ("auto", "flash", "torch", "eager")
DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
EXECUTIONS = ("auto", "eager", "graphs")
DEFAULT_PREFILL_WINDOW = 512  # the reference's draft prefill window with retrieval
_FROZEN = ConfigDict(extra="forbid")
_SECRETS = ConfigDict(extra="forbid", hide_input_in_errors=True)  # holds a secret: errors never echo input


def _flat(name: str) -> dict:
    return {"flat": name}


def _only(surface: str) -> dict:
    return {"surfaces": (surface,)}


def _secret_input(value: Any) -> Any:
    """A secret's input never reaches an error message: a number (YAML `api_key: 1234`) is its
    digits, any other non-string an invalid, masked value that ServingConfig refuses by name."""
    if value is None or isinstance(value, (str, SecretStr)):
        return value
    return SecretStr(str(value) if isinstance(value, int) and not isinstance(value, bool) else "")


def _on_off(value: Any) -> Any:
    """A switch that also has "auto": true and false are "on" and "off"."""
    return ("on" if value else "off") if isinstance(value, bool) else value


def header_token(value: str) -> bool:
    """A value that fits `Authorization: Bearer <value>` as it is."""
    return 0 < len(value) <= 1024 and all("!" <= c <= "~" for c in value)


@dataclass(frozen=True, config=_FROZEN)
class TreeConfig:
    """Shape of the dynamic draft tree (docs/architecture.md, "Draft tree")."""

    nodes: int = Field(16, ge=1, le=1024, description="best draft nodes sent for verification (root excluded)")
    depth: int = Field(6, ge=1, le=64, description="maximum depth of the draft tree")
    topk: int = Field(4, ge=1, le=64, description="children per expanded node and frontier width")


@dataclass(frozen=True, config=_FROZEN)
class RetrievalConfig:
    """Cross-model retrieval (docs/architecture.md, "Cross-model retrieval")."""

    enabled: Optional[bool] = Field(None, description="cross-model retrieval (default: on in specextend mode)",
                                    json_schema_extra=_flat("retrieval"))
    chunk_size: int = Field(32, ge=1, le=65536, description="tokens per retrieval chunk")
    top_k: int = Field(32, ge=1, description="chunks the draft keeps")
    every: int = Field(4, ge=1, description="verified trees between retrieval refreshes")
    sink_chunks: int = Field(1, ge=0, description="first chunks always kept (attention sink)")
    recent_chunks: int = Field(1, ge=0, description="last chunks always kept")
    select: Literal["attention", "recency"] = Field(
        "attention", description="attention: the target's final-layer attention picks the chunks; recency: "
                                 "sink + most recent chunks (a plain window of the same budget, a baseline)")
    draft_prefill_window: Optional[int] = Field(
        None, ge=0, description="sliding window of the draft's prefill (default 512 with retrieval, else 0 = full)",
        json_schema_extra=_flat("draft_prefill_window"))

    def __post_init__(self) -> None:
        if self.enabled is not None and self.draft_prefill_window is None:  # else EngineConfig decides
            window = DEFAULT_PREFILL_WINDOW if self.enabled else 0
            object.__setattr__(self, "draft_prefill_window", window)
        if self.sink_chunks + self.recent_chunks > self.top_k:
            raise ValueError("retrieval_sink_chunks + retrieval_recent_chunks must fit retrieval_top_k")

    @property
    def budget_tokens(self) -> int:
        return self.chunk_size * self.top_k


@dataclass(frozen=True, config=_FROZEN)
class EngineConfig:
    """Everything one engine (target + draft pair) is built from."""

    target: str = Field("default", min_length=1,
                        description="target model: default, random:<preset>, a folder, a .gguf file or a hub id")
    draft: str = Field("default", min_length=1, description="draft model (same forms as target)")
    mode: Literal["ar", "lookup", "sd", "specextend"] = Field(
        "specextend", description="ar: plain decoding; lookup: context lookup alone (no draft model); sd: tree "
                                  "speculative decoding; specextend: + HTA + retrieval")
    tree: TreeConfig = Field(default_factory=TreeConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    hybrid_attention: Optional[bool] = Field(
        None, description="Hybrid Tree Attention verification (default: on in specextend mode)")
    tree_policy: Literal["adaptive", "fixed"] = Field(
        "adaptive", description="adaptive: speculate only while it pays, measured per session (else plain "
                                "steps, with probes); fixed: every step speculative")
    draft_overlap: Optional[bool] = Field(
        None, description="the draft keeps drafting while the target verifies (default: on when the draft "
                          "has a GPU of its own; sharing the target's, it runs on a CUDA stream of its own and "
                          "pays only where the target leaves the GPU room)")
    overlap_miss: Literal["plain", "draft"] = Field(
        "plain", description="with draft_overlap, a step whose tree the draft has not ready: plain decodes one "
                             "token on the target while the draft catches up; draft waits for the draft to draft one")
    draft_prepare: bool = Field(
        False, description="with draft_overlap: the draft prepares the next trees for the likeliest verdicts "
                           "while the target verifies, so that a verdict among them takes no step call (any "
                           "other is asked early; off: not yet measured to pay)")
    lookup_tokens: int = Field(
        8, ge=0, le=32, description="context lookup: up to this many tokens that followed the context's last "
                                    "3 (else 2, else 1) tokens where they occurred before, grafted onto each tree "
                                    "and verified on steps without one where a per-request gate finds them worth "
                                    "their rows (0: off; speculative modes only; mode lookup: the only drafts)")
    draft_tell: bool = Field(
        True, description="with draft_overlap: each plain step sends the tokens committed so far to the draft "
                          "while its forward runs, so that the draft's pool follows plain and lookup steps "
                          "(false: they go with the next tree's call; benchmarks' A/B)")
    draft_ask_early: bool = Field(
        True, description="with draft_tell: a tree step's verdict goes to the draft as soon as it is known and "
                          "the answer (the next tree) is read when the next step needs it, so that the round trip "
                          "overlaps the step's commit and bookkeeping (false: the next step asks; benchmarks' A/B)")
    draft_snapshots: Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)] = Field(
        "auto", description="with draft_overlap: every step's tokens go to the draft at once and each answer is "
                            "a snapshot of its pool's best nodes; a tree step walks the latest snapshot to its own "
                            "position instead of calling the draft (auto: while at least half of a request's trees "
                            "come from snapshots, tried again every 8th request after one where they did not, and "
                            "given up within a request where under a quarter of 16 or more do; ignored where "
                            "draft_prepare is on)")
    draft_overlap_rows: int = Field(
        8, ge=1, le=32, description="with draft_overlap: pool nodes each background forward of the draft takes "
                                    "(a small draft streams its weights whatever the row count)")
    draft_handover: bool = Field(
        True, description="the draft's thread waits (up to 2 ms) until a step's answer has been sent before its "
                          "next work, which would hold the GIL the sender needs (false: benchmarks' A/B)")
    attention_backend: Literal["auto", "flash", "torch", "eager"] = Field("auto", description="attention kernels")
    execution: Literal["auto", "eager", "graphs"] = Field(
        "auto", description="decode-time forwards: graphs (CUDA graphs + Triton kernels), eager, or auto "
                            "(graphs on CUDA)")
    plain_ahead: bool = Field(
        True, description="a request that decodes plainly throughout (mode ar, or speculation off, with no "
                          "context lookup) queues each forward with its input token still on the device, before the "
                          "host reads the token before it, so that the host's work per token overlaps the device's; "
                          "a speculative request's plain steps do so in runs between the adaptive policy's probes, "
                          "where no context lookup chain could pay "
                          "(false: each token is read before the next forward; the slow twin)")
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = Field(
        "auto", description="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")
    device: str = Field("auto", min_length=1, description="auto, cpu, cuda or cuda:N",
                        json_schema_extra=_only("cli"))
    prefill_chunk: int = Field(2048, ge=16, description="prompt tokens per prefill forward")
    prefix_cache_gb: float = Field(
        2.0, ge=0, description="most memory for the K/V of recent prompts, reused whole chunks at a time by a "
                               "later prompt that starts with the same tokens (0: off; served, the target's holds "
                               "only what admitted sessions leave of the KV budget)")
    max_prompt_tokens: Optional[int] = Field(None, ge=1, description="longest prompt (default: the target's context)")
    model_cache: bool = Field(
        True, description="keep GGUF models converted (config, tokenizer, weights per dtype) under "
                          "$SPECEXTEND_CACHE/converted, so that later starts skip the conversion")
    max_new_tokens: int = Field(4096, ge=1, description="largest max_tokens a request may ask for",
                                json_schema_extra=_only("serve"))

    def __post_init__(self) -> None:
        # resolve the mode's defaults, once (the only place they are decided)
        spec = self.mode == "specextend"
        if self.mode == "lookup" and not self.lookup_tokens:
            raise ValueError("mode 'lookup' needs lookup_tokens > 0 (its drafts are the context's chains)")
        if self.hybrid_attention is None:  # lookup verifies chains over the long prefix: HTA too
            object.__setattr__(self, "hybrid_attention", spec or self.mode == "lookup")
        r = self.retrieval
        enabled = spec if r.enabled is None else r.enabled
        window = r.draft_prefill_window
        if window is None:
            window = DEFAULT_PREFILL_WINDOW if enabled else 0
        if (enabled, window) != (r.enabled, r.draft_prefill_window):
            object.__setattr__(self, "retrieval", replace(r, enabled=enabled, draft_prefill_window=window))

    @property
    def uses_draft(self) -> bool:
        return self.mode in ("sd", "specextend")

    @property
    def overlap(self) -> bool:
        """Overlapped drafting (None, unresolved outside the served app, means off)."""
        return bool(self.draft_overlap) and self.uses_draft


STREAM_INTERVAL_MS = 10.0  # docs/architecture.md, "Serving surface": what it saves, what it costs
STREAM_ITEMS_PER_S = 200.0  # the same section: every item costs the replica, the ingress and the proxy


def _default_num_gpus() -> float:
    try:
        import torch

        return 1.0 if torch.cuda.is_available() else 0.0
    except Exception:  # noqa: BLE001 - no torch / broken CUDA: run on CPU
        return 0.0


@dataclass(frozen=True, config=_SECRETS)
class ServingConfig:
    """What only the served application needs (Serve arguments)."""

    num_gpus: float = Field(default_factory=_default_num_gpus, ge=0, le=8,
                            description="GPUs per model (target replica, draft actor); 0 = CPU")
    max_concurrent_sessions: int = Field(16, ge=1, le=4096, description="sessions a replica runs at once")
    max_batch_sessions: int = Field(8, ge=1, le=256,
                                    description="sessions whose steps one target forward carries (1: one at a time)")
    max_batch_tokens: Optional[int] = Field(
        4096, ge=1, le=1 << 20, description="rows a round of batched steps carries: every session's step, then prompt "
                                            "chunks within this (at least one a round; null: no bound)")
    batch_governor: bool = Field(True, description="a batch of 4 or more sessions measures its rounds with the "
                                 "sessions' choices free, held to plain steps and held to trees, and keeps the regime "
                                 "that decodes most (governor.py); false: each session's policy decides alone")
    max_queued_requests: int = Field(64, ge=0, le=65536, description="requests a replica queues beyond that; then 429")
    stream_interval_ms: float = Field(
        STREAM_INTERVAL_MS, ge=0, le=1000, description="a stream's tokens leave the replica at most once per this "
        "interval (the first token and the finish at once): fast steps share one item and one SSE chunk; 0: every step "
        "(while the streams' share of stream_items_per_s allows)")
    stream_items_per_s: float = Field(
        STREAM_ITEMS_PER_S, ge=0, le=100_000, description="streamed items a second that leave a replica, shared by "
        "its streams: with N streams each waits at least N / this between items (above the interval); 0: no bound")
    served_model_name: Optional[str] = Field(None, min_length=1, description="model id of the API (default: the target's)")
    switch_interval_ms: Optional[float] = Field(
        None, gt=0, le=100, description="the replica's and the draft actor's interpreter switch interval "
        "(sys.setswitchinterval): the longest a thread that woke (the engine's, a step's reply, the draft's "
        "channel) waits for the interpreter lock while another thread's Python holds it (default: the "
        "interpreter's, 5 ms; the draft's 0.2 ms with overlap)")
    draft_timeout_s: float = Field(10.0, gt=0, le=3600, description="deadline of one draft step RPC")
    draft_in_replica: bool = Field(
        False, description="the draft in the target replica's process (a worker on a CUDA stream of its own; no "
                           "actor, no RPC) instead of a draft actor; needs 0 < num_gpus < 1: the replica takes both "
                           "models' share of the GPU. It drafts when asked unless draft_overlap is set: overlapped "
                           "there it slowed the target's forwards (docs/architecture.md, \"Overlapped drafting\")")
    step_transport: Literal["zmq", "grpc"] = Field(
        "zmq", description="how the target sends each step to its draft: zmq (the ZeroMQ step channel, with "
                           "gRPC as its fallback) or grpc (one StepStream per session)")
    kv_cache_memory_gb: Optional[float] = Field(
        None, gt=0, description="KV budget for admission (default: 90 percent of free GPU memory, a quarter of host memory on CPU)")
    max_request_bytes: int = Field(
        32 * 2**20, ge=1024, description="largest request body in bytes, then 413 (the default holds a 1M-token "
                                         "prompt as token ids)")
    request_read_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="deadline for a request body to arrive in full, then 408 (slow or "
                                         "short bodies)")
    replay_accept_length: Optional[int] = Field(
        None, ge=0, le=64, description="benchmarks only: force every step to accept this many draft tokens (replayed)")
    benchmark_references: bool = Field(
        False, description="benchmarks only: a greedy request may carry speculative_decoding.reference_token_ids, "
                           "the tokens to emit where the target's choice differs (every mode then decodes the same "
                           "text; the response reports the overrides and their largest top-two gap)")
    replay_bonus: Literal["target", "draft"] = Field(
        "target", description="benchmarks only, with replay_accept_length: each replayed step's bonus token is the "
                              "target's own, or the draft's second choice where the path stops (a verdict an "
                              "overlapping draft can have ready; random weights' own never are)")
    api_key: Annotated[Optional[SecretStr], BeforeValidator(_secret_input)] = Field(
        None, description="clients must send `Authorization: Bearer <key>` (default: $SPECEXTEND_API_KEY, read "
                          "where the ingress runs; neither: no authentication). Prefer the environment "
                          "variable: Serve shows arguments in its dashboard")

    def __post_init__(self) -> None:
        if self.num_gpus > 1 and not float(self.num_gpus).is_integer():
            raise ValueError("num_gpus above 1 must be a whole number")
        if self.draft_in_replica and self.num_gpus >= 1:  # (the replica's process puts both on one device)
            raise ValueError("draft_in_replica runs the draft on the target's GPU: pass num_gpus below 1 "
                             "(e.g. 0.5, the two models' shares of one GPU), or leave the draft to its actor")
        if self.api_key is not None and not header_token(self.api_key.get_secret_value()):
            raise ValueError("api_key must be a string of 1 to 1024 printable ASCII characters without spaces")


@dataclass(frozen=True, config=_SECRETS)
class AppConfig:
    """The root of the tree for the served application."""

    engine: EngineConfig = Field(default_factory=EngineConfig, json_schema_extra={"prefix": ""})
    serving: ServingConfig = Field(default_factory=ServingConfig,
                                   json_schema_extra={"prefix": "", "surfaces": ("serve",)})

    def __post_init__(self) -> None:
        # the served app places the models by num_gpus; the draft overlaps when it has a GPU of its own
        # (num_gpus >= 1). On a shared GPU it drafts when asked, in an actor or in the replica's process
        # (draft_in_replica): overlapped there its kernels and host work slowed the target's steps
        # (docs/architecture.md, "Overlapped drafting")
        engine, gpus = self.engine, self.serving.num_gpus
        changes = {}
        if engine.device == "auto":
            changes["device"] = "cuda" if gpus > 0 else "cpu"
        if engine.draft_overlap is None:
            changes["draft_overlap"] = engine.uses_draft and gpus >= 1
        if changes:
            object.__setattr__(self, "engine", replace(engine, **changes))

    @property
    def gpus_per_replica(self) -> float:
        return self.serving.num_gpus * (2 if self.engine.uses_draft else 1)



@_std_dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (not configuration). temperature 0 = greedy."""

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
