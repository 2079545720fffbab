"""One request's state on the target side: its KV cache and the forwards that use it.

Invariant between steps: the cache holds every committed token except the last one, which is the
root of the next draft tree (or the next autoregressive input).
"""

from __future__ import annotations

import time
from typing import Generator, Optional, Sequence, TypeVar, Union

import torch

from specextend.attention.backends import CAUSAL
from specextend.config import RetrievalConfig
from specextend.models.batch import ForwardCall, Result
from specextend.models.decoder import Captured, Decoder, ForwardOptions
from specextend.models.transfer import to_device
from specextend.kv_pool import KVPool
from specextend.prefix_cache import PrefixCache
from specextend.session_calls import DraftCall
from specextend.draft.base import Retrieval
from specextend.retrieval import (DeferredRetrieval, chunk_scores, initial_chunks, last_token_probs, score_chunks,
                                  select_chunks)
from specextend.tree import ancestor_mask_cached, node_depths

T = TypeVar("T")


class TargetSession:
    def __init__(self, model: Decoder, capacity: int, hybrid: bool, pool: Optional[KVPool] = None):
        self.model = model
        cache = pool.take(capacity) if pool is not None else None  # a batching driver's slot (kv_pool.py)
        self.cache = cache if cache is not None else model.new_cache(capacity)
        self.hybrid = hybrid
        self.captured: Optional[Captured] = None
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache (prefill_co)
        self.history = None  # the request's tokens on the device (lookup_ahead.DeviceHistory), from its first lookup run

    # Each forward comes in two forms: a coroutine (`*_co`) that yields its ForwardCall and gets the
    # forward's result back (the engine's sessions, batched with other sessions' forwards,
    # docs/architecture.md, "Batched steps"), and a plain method that runs it in place.
    def run(self, co: Generator[ForwardCall, Result, T]) -> T:
        """Drives a forward coroutine with this session's model, one forward at a time."""
        try:
            call = next(co)
            while True:
                call = co.send(call.result() if isinstance(call, DraftCall) else call.run(self.model))
        except StopIteration as stop:
            return stop.value

    def prefill(self, prompt_ids: Sequence[int], chunk: int, capture: bool = False) -> torch.Tensor:
        """Chunked causal prefill of the prompt; returns the last position's logits [V]."""
        return self.run(self.prefill_co(prompt_ids, chunk, capture))

    def prefill_co(self, prompt_ids: Sequence[int], chunk: int, capture: bool = False,
                   prefix: Optional[PrefixCache] = None) -> Generator[Union[ForwardCall, DraftCall], Result, torch.Tensor]:
        """The prefill one chunk per forward (a batched driver runs other sessions' steps between
        them): the last position's logits [V]. With `prefix` (docs/architecture.md, "Prefix
        caching"): first, while another session's prefill will store more of this prompt's whole
        chunks than the cache holds, it waits for that (a DraftCall on its future: rounds go on
        without it); then the longest cached run is copied in (`cached_tokens`), the prefill goes
        on after it, and the prompt's whole chunks are kept for later prompts."""
        ids = to_device(list(prompt_ids), torch.long, self.model.device)  # (pinned: never waits for queued forwards)
        promise = None
        if prefix is not None:
            while (wait := prefix.awaited(prompt_ids)) is not None:
                yield DraftCall(future=wait)
            self.cached_tokens = prefix.load(prompt_ids, self.cache)
            promise = prefix.promise(prompt_ids, self.cached_tokens)
        try:
            for lo in range(self.cached_tokens, ids.numel(), chunk):
                logits = yield from self.prefill_chunk_co(ids, lo, chunk, capture)
            if prefix is not None:  # (a device copy: ~0.25 ms for the 1.5B's 16K tokens at 4 TB/s)
                prefix.store(prompt_ids, self.cache)
        finally:  # (stored, or failed or closed: a session waiting for it looks up again)
            if promise is not None:
                prefix.fulfil(promise)
        return logits

    def prefill_chunk_co(self, ids: torch.Tensor, lo: int, chunk: int,
                         capture: bool = False) -> Generator[ForwardCall, Result, Optional[torch.Tensor]]:
        """The causal prefill of ids[lo:lo + chunk] (ids [P] on the model's device): None, or after
        the last chunk the last position's logits [V]. `capture` keeps the last chunk's
        final-layer queries and LSE for the first retrieval."""
        dev = self.model.device
        part = ids[lo:lo + chunk]
        t = part.numel()
        last = lo + t >= ids.numel()
        # eager, never a graph: a prompt's last chunk has any length up to 64 (a graph per length
        # would be captured on the request's path: 2026-11-27, docs/architecture.md, "Execution plans")
        logits, captured = yield ForwardCall(
            part, torch.arange(lo, lo + t, device=dev), self.cache, CAUSAL,
            ForwardOptions(hybrid=True, logits_rows=to_device([t - 1], torch.long, dev),
                           capture_last=capture and last, graphs=False), prompt=True)
        self.cache.advance(t)
        if last:
            self.captured = captured
        return logits[0] if last else None

    def decode(self, token: int) -> torch.Tensor:
        """Autoregressive step: forward the last committed token; returns its logits [V]."""
        return self.run(self.decode_co(token))

    def decode_co(self, token: Union[int, torch.Tensor]) -> Generator[ForwardCall, Result, torch.Tensor]:
        """`token`: a host id, or a [1] int64 tensor on the model's device, still being computed
        there (plain steps ahead: the forward copies it into its input where the device reaches it)."""
        if isinstance(token, torch.Tensor):
            ids, positions = token, to_device([self.cache.length], torch.long, self.model.device)  # [1], [1]
        else:
            both = to_device([token, self.cache.length], torch.long, self.model.device)  # one copy: id, position
            ids, positions = both[:1], both[1:]
        logits, _ = yield ForwardCall(ids, positions, self.cache, CAUSAL)
        self.cache.advance(1)
        return logits[0]

    def verify(self, root: int, tokens: Sequence[int], parents: Sequence[int], capture: bool) -> torch.Tensor:
        """One forward over [root] + tree with the tree mask; returns logits [N+1, V]."""
        return self.run(self.verify_co(root, tokens, parents, capture))

    def verify_co(self, root: int, tokens: Sequence[int], parents: Sequence[int],
                  capture: bool) -> Generator[ForwardCall, Result, torch.Tensor]:
        dev = self.model.device
        n = len(tokens) + 1
        # one copy: ids [N+1], then positions [N+1] (the committed length + each node's depth)
        both = to_device([root, *tokens] + [self.cache.length + d for d in [0] + node_depths(parents)], torch.long, dev)
        logits, self.captured = yield ForwardCall(
            both[:n], both[n:], self.cache, ancestor_mask_cached(parents, dev),
            ForwardOptions(hybrid=self.hybrid, capture_last=capture))
        return logits

    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the root and the accepted nodes' K/V in contiguous slots; drop the rest."""
        keep = [0] + [a + 1 for a in accepted]
        if keep == list(range(len(keep))):  # a prefix of the staged slots (a lookup chain's accepted
            self.cache.advance(len(keep))  # tokens, a first-child path): already in place, no gather
            return
        self.cache.commit(to_device(keep, torch.long, self.model.device))

    def timed_selection(self, row: int, cfg: RetrievalConfig, stats) -> Optional[Union[Retrieval, DeferredRetrieval]]:
        """`selection`, its host time added to `stats.retrieval_s` (on a GPU the ids are read by the
        call that carries them)."""
        t0 = time.perf_counter()
        out = self.selection(row, cfg)
        stats.retrieval_s += time.perf_counter() - t0
        return out

    def selection(self, row: int, cfg: RetrievalConfig,
                  lazy: Optional[bool] = None) -> Optional[Union[Retrieval, DeferredRetrieval]]:
        """retrieval_chunks as the draft's Retrieval (None: nothing to send). On a GPU the scores are
        not even queued here: a DeferredRetrieval.later holds the query row, its LSE and a view of
        the keys, and is scored when launched (the engine launches it in the next forward's shadow)
        and read when a call carries it. The keys it reads, cache slots [0, length), stay as they
        are: later steps write only past them. `lazy` (default: on a GPU) False: scored and read here,
        retrieval_chunks (the twin)."""
        ctx = self.cache.length
        lazy = self.model.device.type == "cuda" if lazy is None else lazy
        if (not lazy or cfg.select != "attention" or self.captured is None
                or -(-ctx // cfg.chunk_size) <= cfg.top_k):
            ids = self.retrieval_chunks(row, cfg)
            return Retrieval(tuple(ids), cfg.chunk_size) if ids else None
        q = self.captured.q[:, row].clone()  # [H, D] (the capture's buffers are reused by later forwards)
        lse = self.captured.lse[:, row].clone()  # [H]
        keys = self.cache.layer(self.model.args.num_layers - 1)[0][:, :ctx]  # [G, ctx, D], a view
        scale = self.model.scale

        def score() -> torch.Tensor:  # [K] chunk ids on the device
            return score_chunks(q, lse, keys, scale, cfg)
        return DeferredRetrieval.later(score, self.model.device, cfg.chunk_size)

    def retrieval_chunks(self, row: int, cfg: RetrievalConfig) -> Optional[list[int]]:
        """Chunk ids for the draft from the captured forward's query `row` (call after commit).

        After a verification, the row of the last accepted node: its final-layer probabilities
        over every key it saw (prefix, root and accepted path, now cache slots [0, length)) from
        its query row and merged LSE. After the prefill, the prompt's last token (row -1): the
        draft's first tree then drafts from retrieved chunks, not from a recency guess. With
        `select="recency"`, the sink and most recent chunks (docs/architecture.md, "Baselines")."""
        ctx = self.cache.length
        if -(-ctx // cfg.chunk_size) <= cfg.top_k:
            return None  # everything fits the budget: retrieval is a no-op
        if cfg.select == "recency":  # the baseline window: no scores needed
            return initial_chunks(ctx, cfg)
        if self.captured is None:
            return None
        keys = self.cache.layer(self.model.args.num_layers - 1)[0][:, :ctx]  # [G, ctx, D]
        probs = last_token_probs(self.captured.q[:, row], self.captured.lse[:, row], keys, self.model.scale)
        scores = chunk_scores(probs, cfg.chunk_size)
        return select_chunks(scores, cfg)
