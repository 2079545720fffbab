"""Cross-model Retrieval (docs/architecture.md, "Cross-model retrieval"). Pure functions.

Target side: the final-layer attention probabilities of the last accepted token, recovered from
its query row and merged log-sum-exp of the verify pass (no eager re-run), averaged over heads,
pooled into chunk scores; the best chunks within the budget are sent to the draft as ids.
Draft side: chunk ids -> token positions to keep in the working cache.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch

from specextend.config import RetrievalConfig


def last_token_probs(
    q: torch.Tensor,  # [H, D] post-RoPE query of the last accepted token, final layer
    lse: torch.Tensor,  # [H] its merged log-sum-exp over every key it saw
    keys: torch.Tensor,  # [G, S, D] the keys it saw: prefix + accepted path up to itself
    scale: float,
) -> torch.Tensor:
    """Softmax row of each head, exp(q.k * scale - lse), averaged over query heads -> [S] float32."""
    h, d = q.shape
    g = keys.shape[0]
    qg = q.float().reshape(g, h // g, d)  # [G, H/G, D] (GQA: each head uses its group's keys)
    logits = torch.einsum("grd,gsd->grs", qg, keys.float()) * scale  # [G, H/G, S]
    probs = torch.exp(logits - lse.float().reshape(g, h // g, 1))
    return probs.mean(dim=(0, 1))  # [S]


def chunk_scores(probs: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """probs [S] -> mean per chunk of C tokens [ceil(S / C)] (the last chunk may be partial)."""
    s = probs.shape[0]
    nc = -(-s // chunk_size)
    pad = nc * chunk_size - s
    sums = torch.nn.functional.pad(probs, (0, pad)).reshape(nc, chunk_size).sum(-1)
    counts = torch.full((nc,), float(chunk_size), device=probs.device)
    counts[-1] = chunk_size - pad
    return sums / counts


def select_chunks(scores: torch.Tensor, cfg: RetrievalConfig) -> list[int]:
    """Budget of cfg.top_k chunks: sink and recent chunks always, then the best others, sorted."""
    nc = scores.shape[0]
    if nc <= cfg.top_k:
        return list(range(nc))
    forced = set(range(min(cfg.sink_chunks, nc))) | set(range(max(nc - cfg.recent_chunks, 0), nc))
    rest = cfg.top_k - len(forced)
    masked = scores.clone().float()
    if forced:
        masked[list(forced)] = float("-inf")
    best = torch.topk(masked, rest).indices.tolist() if rest > 0 else []
    return sorted(forced | set(best))


def select_chunks_device(scores: torch.Tensor, cfg: RetrievalConfig) -> torch.Tensor:
    """select_chunks on the scores' device, with no wait for it: [K] sorted chunk ids (int64). Its
    twin is select_chunks (the same top-k over the same masked scores; tests compare them)."""
    nc, dev = scores.shape[0], scores.device
    if nc <= cfg.top_k:
        return torch.arange(nc, device=dev)
    sink, recent = min(cfg.sink_chunks, nc), min(cfg.recent_chunks, nc)  # disjoint: nc > top_k >= both
    forced = torch.cat([torch.arange(sink, device=dev), torch.arange(nc - recent, nc, device=dev)])  # [F]
    masked = scores.float().index_fill(0, forced, float("-inf"))  # [nc]
    rest = cfg.top_k - forced.numel()
    best = torch.topk(masked, rest).indices if rest > 0 else forced[:0]  # [K - F]
    return torch.sort(torch.cat([forced, best])).values  # [K]


def score_chunks(
    q: torch.Tensor,  # [H, D] post-RoPE query of the last accepted token, final layer
    lse: torch.Tensor,  # [H] its merged log-sum-exp
    keys: torch.Tensor,  # [G, S, D] the keys it saw
    scale: float,
    cfg: RetrievalConfig,
) -> torch.Tensor:
    """The chunk ids the draft keeps, scored from the target's final-layer attention, on the
    device with no wait -> [K] int64 (last_token_probs, chunk_scores, select_chunks_device)."""
    return select_chunks_device(chunk_scores(last_token_probs(q, lse, keys, scale), cfg.chunk_size), cfg)


class DeferredRetrieval:
    """A retrieval selection (draft.base.Retrieval's fields) whose chunk ids are still on their way
    from the device: copied into pinned memory without a wait when scored, read (waiting for that
    copy alone) where a draft call first uses them, on the thread that makes the call. The scoring
    used to end in a host read on the tree step's path, after the verification's commit
    (docs/architecture.md, "Cross-model retrieval").

    `later` makes one whose scoring itself waits: its kernels are queued by `launch`, which the
    engine calls once the next target forward is queued (their host work then runs while the
    device runs that forward), and in any case before it hands the selection to a call, which may
    run on another thread: a CUDA graph captured on the engine's thread forbids other threads'
    device work meanwhile. A read launches one that was not (a fallback). The kernels run on the
    stream that was current where it was made, after the forward that captured the query."""

    __slots__ = ("_score", "_stream", "_lock", "_host", "_event", "_ids", "chunk_size")

    def __init__(self, ids: Optional[torch.Tensor], chunk_size: int) -> None:  # ids [K] on the device
        self._score = self._stream = self._host = self._event = None
        self._lock = threading.Lock()
        self._ids: Optional[tuple[int, ...]] = None
        self.chunk_size = chunk_size
        if ids is not None:
            self._copy(ids)

    @classmethod
    def later(cls, score: Callable[[], torch.Tensor], device: torch.device, chunk_size: int) -> "DeferredRetrieval":
        """A selection scored by `score()` (-> ids [K] on `device`) when launched."""
        out = cls(None, chunk_size)
        out._score = score
        out._stream = torch.cuda.current_stream(device) if torch.device(device).type == "cuda" else None
        return out

    def _copy(self, ids: torch.Tensor) -> None:
        from specextend.models.transfer import record_event, to_host

        self._host = to_host(ids)
        self._event = record_event(ids.device)  # (None on the CPU: the copy is done)

    @property
    def launched(self) -> bool:
        return self._host is not None

    def launch(self) -> None:
        """Queue the scoring and the copy of its ids (once; any thread)."""
        if self.launched:
            return
        with self._lock:
            if self.launched:
                return
            if self._stream is None:
                self._copy(self._score())
            else:
                with torch.cuda.stream(self._stream):
                    self._copy(self._score())
            self._score = None  # (drops the query, LSE and key views it held)

    @property
    def on_host(self) -> bool:
        """Its ids can be read without waiting for the device (launched, and the copy has passed)."""
        return self._ids is not None or (self.launched and (self._event is None or self._event.query()))

    @property
    def chunk_ids(self) -> tuple[int, ...]:
        if self._ids is None:
            self.launch()
            if self._event is not None:
                self._event.synchronize()
            self._ids = tuple(self._host.tolist())
        return self._ids

    def __repr__(self) -> str:
        return f"DeferredRetrieval({self.chunk_ids}, {self.chunk_size})"


def launch_scoring(retrieval) -> None:
    """Queue a selection's scoring if it still waits for it (DeferredRetrieval.later); anything else
    (None, a Retrieval) as it is. The engine calls it once a target forward is queued, so that the
    scoring's host work runs while the device runs that forward."""
    if isinstance(retrieval, DeferredRetrieval):
        retrieval.launch()


def initial_chunks(num_tokens: int, cfg: RetrievalConfig) -> list[int]:
    """Before the first scores: the sink chunks and the most recent chunks, within the budget."""
    nc = -(-num_tokens // cfg.chunk_size)
    if nc <= cfg.top_k:
        return list(range(nc))
    sink = list(range(min(cfg.sink_chunks, cfg.top_k)))
    return sink + list(range(nc - (cfg.top_k - len(sink)), nc))


def chunk_positions(chunk_ids: Sequence[int], chunk_size: int, limit: int) -> torch.Tensor:
    """Token positions (< limit) covered by the chunk ids, in document order -> [W] int64."""
    ids = torch.tensor(sorted(set(int(c) for c in chunk_ids if c >= 0)), dtype=torch.int64)
    pos = (ids[:, None] * chunk_size + torch.arange(chunk_size)[None, :]).reshape(-1)
    return pos[pos < limit]
