"""One target forward for the steps of several sessions (docs/architecture.md, "Batched steps").

Each session's forward is a `ForwardCall` over its own KV cache (a prefill chunk, a decode
token, a verification tree). `forward_batch` runs their rows together through every matrix
product (embedding, QKV, output projection, MLP, LM head: the weights are read once for the
whole batch) and each call's attention over its own cache, with its own mask. A single call goes
through `Decoder.forward` (the step graphs when they take it). With full-step graphs, the target's
decode tokens and trees (and the draft's tree levels of one depth) run as one graphed forward,
each session's tokens padded to the largest count (FullStepGraphs.forward_batch); calls the graphs
take only alone replay them one by one; the others batch eagerly, or go one by one when only a few
are left (GRAPHS_BATCH_MIN). `forward_each` is the slow twin (one forward per call), and the tests compare
them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Generator, Optional, TypeVar

import torch

from specextend.attention.backends import CAUSAL, Mask, causal_mask
from specextend.kv_cache import CacheFull, KVCache
from specextend.kv_pool import PoolBatch, pooled_attention
from specextend.models.decoder import Captured, Decoder, ForwardOptions


@dataclass
class ForwardCall:
    """One session's forward: Decoder.forward's arguments."""

    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cache: KVCache
    mask: Mask  # CAUSAL, or [T, staged + T] bool
    opts: ForwardOptions = field(default_factory=ForwardOptions)
    prompt: bool = False  # a prompt's prefill chunk: a round's token budget may hold it for a later round

    at_device_length = False  # AtDeviceLength: its committed length is on the device; it runs alone

    def run(self, model: Decoder) -> "Result":
        """This forward alone, through Decoder.forward (the step graphs when they take it)."""
        return model.forward(self.ids, self.positions, self.cache, self.mask, self.opts)


class AtDeviceLength(ForwardCall):
    """A causal path's forward after the cache's first `positions[0]` committed keys, a [1] tensor on the
    device that the host has not read (lookup_ahead.py): `forward_at`. It never batches with others."""

    at_device_length = True

    def run(self, model: Decoder) -> "Result":
        return forward_at(model, self.ids, self.positions, self.cache), None


def forward_at(model: Decoder, ids: torch.Tensor, start: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [T, V] of the path ids [T] after the cache's first `start` ([1] int64 on the device)
    committed keys, staged at [start, start + T). Through full-step graphs the host never reads
    `start` (FullStepGraphs.forward_at); elsewhere its twin reads it (a synchronisation) and runs
    the forward as any other, leaving cache.length at `start`."""
    t = ids.shape[0]
    if model.graphs is not None and model.graphs.takes_device_length(t) and cache.length > 0:
        return model.graphs.forward_at(ids, start, cache)
    cache.length = int(start)  # the twin
    positions = torch.arange(cache.length, cache.length + t, device=ids.device)  # [T]
    return model.forward(ids, positions, cache, CAUSAL)[0]


def _own(result: "Result") -> "Result":
    """A forward_at result that a later forward of the round could overwrite (it is the plan's
    buffer, and another session's call of the same shape may follow it): a copy."""
    return result[0].clone(), result[1]


# With step graphs (CUDA), one call replays a captured graph while an eager batch runs launch by
# launch. The target's decode and verify steps batch through the graphs (batch_key); a call that the
# graphs take only alone (the draft's accepted tokens' forwards, which write the retrieval store)
# replays its graph, one call after another: batched eagerly, eight of them made a round of the 68M
# draft's eight steps 13.7 ms long against 8.2 replayed (H200, 2026-12-02,
# benchmarks/draft_rounds.py). What batches eagerly is what no graph takes (prefill chunks), from
# this many calls on (fewer run one by one; for the 8B target's decode steps, eager batches of 4 and
# 8 were slower than one call per forward and 16 faster: H100, 2026-11-26).
GRAPHS_BATCH_MIN = 4

Result = tuple[torch.Tensor, Optional[Captured]]  # logits [T', V], captured last layer (or, from
# forward_batch, the CacheFull of a call that failed alone)


R = TypeVar("R")


def run_alone(co: Generator[ForwardCall, Result, R], model: Decoder) -> R:
    """Runs a coroutine that yields ForwardCalls (a draft session's step) with each forward run as
    it comes, through Decoder.forward; returns what the coroutine returns."""
    try:
        call = next(co)
        while True:
            call = co.send(call.run(model))
    except StopIteration as stop:
        return stop.value


def forward_each(model: Decoder, calls: list[ForwardCall]) -> list[Result]:
    """The slow twin: one Decoder.forward per call."""
    return [c.run(model) for c in calls]


def forward_batch(model: Decoder, calls: list[ForwardCall]) -> list[Result]:
    """The calls' forwards with their rows batched through the matrix products; results in order.
    Where the step graphs batch (full-step graphs: FullStepGraphs.forward_batch), the calls they
    take run as one graphed forward (as many as it holds, largest first, the others padded to the
    largest); the rest as below (`forward_eager_batch`)."""
    graphs = model.graphs
    if any(c.at_device_length for c in calls):  # (those alone, after the others, which batch)
        others = [c for c in calls if not c.at_device_length]
        done = iter(forward_batch(model, others) if others else [])
        return [_own(c.run(model)) if c.at_device_length else next(done) for c in calls]
    if graphs is None or len(calls) == 1:
        return forward_eager_batch(model, calls)
    keys = [graphs.batch_key(c) for c in calls]  # (staged keys, padded tokens) or None
    rest = [i for i, k in enumerate(keys) if k is None]
    # by staged count, then the largest padded count first
    keyed = sorted(((k, i) for i, k in enumerate(keys) if k is not None), key=lambda ki: (ki[0][0], -ki[0][1]))
    results: list[Optional[Result]] = [None] * len(calls)
    while keyed:  # each forward: the largest count left of a staged count, and as many as it takes
        (staged, tokens), _ = keyed[0]
        part = [i for k, i in keyed[:graphs.max_batch(tokens)] if k[0] == staged]
        keyed = keyed[len(part):]
        if len(part) == 1:
            rest += part
            continue
        for i, r in zip(part, graphs.forward_batch([calls[i] for i in part], tokens)):
            results[i] = r
    rest.sort()
    # a call the step graphs take alone replays its graph; only the others may batch eagerly
    eager = [i for i in rest if not graphs.accepts(calls[i].ids.shape[0], calls[i].cache, calls[i].mask, calls[i].opts)]
    if len(eager) < GRAPHS_BATCH_MIN:
        eager = []
    for i in sorted(set(rest) - set(eager)):  # one by one: a call that fails (a full cache) fails alone
        try:
            results[i] = calls[i].run(model)
        except CacheFull as exc:
            results[i] = exc  # the driver throws it into that session only (scheduler.Batcher)
    if eager:
        for i, r in zip(eager, forward_eager_batch(model, [calls[i] for i in eager])):
            results[i] = r
    return results


def forward_eager_batch(model: Decoder, calls: list[ForwardCall]) -> list[Result]:
    """The calls' rows batched through eager matrix products (each call's attention over its own
    cache); a single call, or a few with step graphs, through Decoder.forward instead."""
    if len(calls) == 1 or (model.graphs is not None and len(calls) < GRAPHS_BATCH_MIN):
        return forward_each(model, calls)
    a = model.args
    sizes = [c.ids.shape[0] for c in calls]  # T_i
    ids = torch.cat([c.ids for c in calls])  # [T], T = sum T_i
    cos, sin = model.rope.cos_sin(torch.cat([c.positions for c in calls]), model.dtype)  # [T, D]
    prefix = [c.cache.length for c in calls]  # each call's committed prefix L_i
    x = model.embed(ids)  # [T, E]
    captured: list[Optional[Captured]] = [None] * len(calls)
    pooled = PooledCalls.of(model, calls, sizes)  # steps in a pool's slots: one attention call a layer
    for i in range(a.num_layers):
        q, k, v, k_pre = model.layer_pre(i, x, cos, sin)  # q [H, T, D]; k, v, k_pre [G, T, D]
        if pooled is not None and pooled.everything:
            x = model.layer_post(i, x, pooled.attend(i, q, k, v, captured))
            continue
        outs = []
        for j, (c, qj, kj, vj, kpj) in enumerate(zip(calls, q.split(sizes, 1), k.split(sizes, 1),
                                                     v.split(sizes, 1), k_pre.split(sizes, 1))):
            if pooled is not None and j in pooled.members:
                outs.append(None)
                continue
            out, cap = model.attend(i, qj, kj, vj, kpj, c.cache, prefix[j], c.mask, c.opts)
            captured[j] = cap or captured[j]
            outs.append(out)  # [H, T_j, D]
        if pooled is not None:
            outs = pooled.fill(outs, pooled.attend(i, q, k, v, captured))
        x = model.layer_post(i, x, torch.cat(outs, 1))
    rows, starts = [], 0
    for c, t in zip(calls, sizes):  # each call's logits rows, as offsets into the batch
        r = c.opts.logits_rows
        rows.append(torch.arange(starts, starts + t, device=ids.device) if r is None else r.to(ids.device) + starts)
        starts += t
    logits = model.head(x, torch.cat(rows))  # [sum T'_i, V]
    return list(zip(logits.split([r.numel() for r in rows]), captured))


POOL_ROWS = 64  # the most rows a call may have to join a round's pooled attention (a tree, a chain)


class PooledCalls:
    """The calls of a batch whose new rows attend their whole cache, each cache a slot of one pool
    (plain steps, trees and lookup chains of batched sessions on the CPU): their K/V written and
    their attention run as one call a layer (kv_pool.pooled_attention) instead of one per call. The
    per-call path is its twin (tests/test_kv_pool.py)."""

    def __init__(self, model: Decoder, calls: list[ForwardCall], members: list[int], rows: list[int],
                 masks: list[torch.Tensor]):
        self.model, self.members = model, set(members)
        self.order = members  # the members' call indexes, in batch order
        caches = [calls[j].cache for j in members]
        self.pool = caches[0].pool
        a = model.args
        self.batch = PoolBatch([c.slot for c in caches], [c.length for c in caches], masks, rows,
                               a.num_heads // a.num_kv_heads, model.dtype)
        self.sizes = [m.shape[0] for m in masks]
        self.everything = len(members) == len(calls)  # (then every row is a member's, in order)
        self.capture = [j for j in members if calls[j].opts.capture_last]

    @classmethod
    def of(cls, model: Decoder, calls: list[ForwardCall], sizes: list[int]) -> Optional["PooledCalls"]:
        pool = next((c.cache.pool for c in calls if c.cache.pool is not None), None)
        if pool is None:
            return None
        members, rows, masks, row = [], [], [], 0
        for j, (c, t) in enumerate(zip(calls, sizes)):
            causal = isinstance(c.mask, str) and c.mask == CAUSAL
            square = causal or (isinstance(c.mask, torch.Tensor) and tuple(c.mask.shape) == (t, t))
            if (t <= POOL_ROWS and c.cache.pool is pool and square and c.opts.store is None
                    and not c.opts.window and not c.opts.staged
                    and c.cache.length + t <= c.cache.capacity):  # (a full cache: the call's own CacheFull)
                members.append(j)
                rows.append(row)
                masks.append(_causal(t) if causal else c.mask.cpu())
            row += t
        return cls(model, calls, members, rows, masks) if len(members) > 1 else None

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               captured: list[Optional[Captured]]) -> torch.Tensor:
        """Layer i's attention of the members -> out [H, N, D] (their rows of q, k, v [*, T, D])."""
        if not self.everything:
            rows = self.batch.rows
            q, k, v = q.index_select(1, rows), k.index_select(1, rows), v.index_select(1, rows)
        need_lse = bool(self.capture) and i == self.model.args.num_layers - 1
        out, lse = pooled_attention(self.pool.data, i, q, k, v, self.batch, self.model.scale, need_lse)
        if need_lse:
            lo = 0
            for j, t in zip(self.order, self.sizes):
                if j in self.capture:
                    captured[j] = Captured(q=q[:, lo:lo + t], lse=lse[:, lo:lo + t].float())
                lo += t
        return out

    def fill(self, outs: list[Optional[torch.Tensor]], out: torch.Tensor) -> list[torch.Tensor]:
        """`outs` (per call, None for the members) with the members' rows of `out` [H, N, D]."""
        mine = iter(out.split(self.sizes, 1))
        return [next(mine) if o is None else o for o in outs]


@functools.lru_cache(maxsize=POOL_ROWS)
def _causal(t: int) -> torch.Tensor:
    """[t, t] bool lower triangle on the CPU (backends.causal_mask, kept: read only)."""
    return causal_mask(t, t, "cpu")
