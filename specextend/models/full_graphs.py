"""Full-step CUDA graphs: the whole decode-time forward (every layer) replayed by a few graph launches.

The piecewise graphs (graphs.py) leave one eager call per layer, the prefix attention, because the
fused SDPA kernels take the prefix length and the cache address from the host. Here that call is
the Triton split-KV kernel of attention/triton_prefix.py, which reads (cache address, L,
capacity) from a small device tensor written before each replay. So one graph per shape serves
every session and every prefix length: a few launches per forward instead of 2 x layers, no idle
gaps between segments, and no copies of the prefix result into static buffers.

Launching a graph costs the host about 1.4 us per node (H100, 2026-11-23: 633 us for the 8B
verify's 446 nodes), and part of that kept the device waiting. The forward is therefore captured
as a few graphs of 1, 2, 4, ... layers (launch_pieces): the device runs the first layer while the
host launches the next two, and so on (8B verify at 16K: 9.15 -> 8.92 ms).

Everything else is shared with graphs.py: the plans (static ids/positions/mask/scratch), the
segments (compiled or not), the scratch-then-copy handling of new K/V. `capture=False` runs the
identical sequence op by op (its slow twin; on the CPU the kernel runs in Triton's interpreter).

Several sessions' forwards run as one (`forward_batch`; docs/architecture.md, "Batched steps"):
their tokens are the rows of one forward, so every projection reads the weights once for all of
them; the tree part's mask is block-structured (a session sees only its own staged and new keys)
and the prefix kernel finds each session's cache through its own meta entry. Each session's tokens are padded to
one count (a decode token beside trees), and batches to a power of two with empty sessions (no
committed keys); padding is dropped from the outputs, so a few graphs serve every batch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch

from specextend.attention.triton_prefix import (ALIGN, TRITON_DTYPES, cache_meta, num_splits, prefix_partials,
                                                 triton_available)
from specextend.kv_cache import KVCache
from specextend.models import persistent as persistent_mod
from specextend.models.capture import capture
from specextend.models.graphs import MAX_GRAPH_TOKENS, ShapeKey, StepGraphs, _Plan, check_room, path_mask
from specextend.models.transfer import copy_from_host, to_device

MAX_BATCH_SESSIONS = 32  # sessions in one batched forward (more: several forwards)
MAX_BATCH_ROWS = 512  # tokens in one batched forward, all its sessions together
BATCH_MASKS = 256  # batched forwards' masks kept, by the calls' sizes and masks (FullStepGraphs._batch_mask)
EMPTY_META = [0, 0, 1, 0]  # a padding session's cache: no committed keys (triton_prefix.cache_meta)


def batch_key_ranges(nb: int, t: int, st: int, device) -> torch.Tensor:
    """[nb * t, 4] int32: each row token's two key ranges in a batched forward of nb sessions of t
    tokens after st staged tree keys each (keys: every session's staged keys, then the new ones):
    its session's staged keys [i * st, (i + 1) * st) and new keys [nb * st + i * t, ... + t). Its
    mask (_batch_mask) is false outside them, so the fused tree kernel reads only these: reading
    every session's keys made the tree part grow with the square of the batch (sixteen 17-node trees:
    tree_combine 13 ms of a round's 34 ms of kernels, H200, 2026-12-02)."""
    i = torch.arange(nb * t) // t  # [nb * t] each token's session
    lo2 = nb * st + i * t
    return torch.stack([i * st, (i + 1) * st, lo2, lo2 + t], 1).to(torch.int32).contiguous().to(device)


def padded_sessions(n: int) -> int:
    """Sessions a batched forward of n is padded to: the next power of two (a graph per size)."""
    return 1 << (n - 1).bit_length()


def full_graphs_supported(model) -> bool:
    """Triton importable, a dtype its kernel takes, and not the eager reference backend."""
    return triton_available() and model.dtype in TRITON_DTYPES and model.backend.name != "eager"


def launch_pieces(steps: int, split: bool = True) -> list[range]:
    """Body steps 0..steps-1 (a layer each, the last the head) cut into graphs of 1, 2, 4, ... steps,
    a short remainder joining the piece before it; one piece if not split. Each launch then costs the
    host less than the device takes to run the piece before it, as long as a layer's kernels run at
    least half as long as their launch takes (~14 us per layer of 10 nodes)."""
    if not split:
        return [range(steps)]
    cuts, lo, size = [], 0, 1
    while lo < steps:
        hi = min(steps, lo + size)
        if cuts and hi - lo < size // 2:  # a short tail: one launch fewer
            cuts[-1] = range(cuts[-1].start, hi)
        else:
            cuts.append(range(lo, hi))
        lo, size = hi, size * 2
    return cuts


class FullStepGraphs(StepGraphs):
    def __init__(self, model, capture: bool = True, max_tokens: int = MAX_GRAPH_TOKENS, compile: bool = False,
                 fused: bool = False, split_launch: bool = True, skinny: bool = False, persistent: bool = False):
        super().__init__(model, capture=capture, max_tokens=max_tokens, compile=compile, fused=fused, skinny=skinny)
        if persistent and not persistent_mod.supported(model):
            raise ValueError("the persistent layer kernel takes half-precision or float32 models without QK-norm")
        self.persistent = persistent  # a layer per launch (persistent.py) for plans of <= MAX_ROWS queries
        self.persist_launch = model.device.type == "cuda"  # False: its twin, one launch per stage
        self.pieces = launch_pieces(model.args.num_layers + 1, split_launch)
        dev = model.device
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        self.anchor = torch.zeros(ALIGN, dtype=model.dtype, device=dev)  # caches are addressed from here
        self.path_offsets = torch.arange(max_tokens, device=dev)  # [max_tokens] past a path's start (forward_at)
        self.batching = True  # several sessions' forwards as one (forward_batch); False: each alone
        # (staged keys, tokens) shapes that batch once warm_batches has captured their plans (None: any,
        # captured when met)
        self.batch_shapes: Optional[frozenset] = None
        self.batched_forwards = 0  # forwards that carried several sessions
        self._batch_masks: OrderedDict = OrderedDict()  # key -> (mask, the calls' masks it came from)

    def _run(self, p: _Plan, cache: KVCache, L: int) -> None:
        self._set_meta(p, cache, L)
        self._replay(p)

    def _replay(self, p: _Plan) -> None:
        """The plan's forward over what its buffers and meta hold: its graphs, or its twin op by op."""
        if self.capture:
            for graph in p.graphs:
                graph.replay()
        else:
            self._body(p)

    def _set_meta(self, p: _Plan, cache: KVCache, L: int) -> None:
        """Every session of the plan reads `cache` (a batched plan's build: any valid cache)."""
        copy_from_host(p.meta, cache_meta(cache.data, self.anchor, L) * p.key.sessions)  # pinned: no wait

    # ------------------------------------------------------------ at a length on the device
    def takes_device_length(self, t: int) -> bool:
        return self.model.device.type == "cuda" and 0 < t <= self.max_tokens

    def forward_at(self, ids: torch.Tensor, start: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """A causal path's forward (ids [T] on the device) after the cache's first `start` ([1] int64 on
        the device, never read by the host) committed keys: the prefix kernel's meta, the positions and
        the new K/V's slots all come from `start` on the device, so the host queues it before the step
        that sets `start` has run (lookup_ahead.py). -> logits [T, V] in the plan's buffer (valid until
        its next forward: read them in stream order first). The caller keeps start + T within the
        cache's capacity; cache.length is left as it was (the host's copy of the length lags)."""
        t = ids.shape[0]
        key = ShapeKey(t, 0, 0, False, False)
        mask = path_mask(t, ids.device)
        with self.lock:
            self.forwards += 1
            p = self._plan(key, cache)
            p.ids.copy_(ids)
            torch.add(start, self.path_offsets[:t], out=p.pos)  # [T]
            p.set_mask(mask)
            copy_from_host(p.meta, cache_meta(cache.data, self.anchor, 0))  # address and capacity ...
            p.meta[1:2].copy_(start)  # ... and the committed length, from the device
            self._replay(p)
            cache.data.index_copy_(3, p.pos, p.scratch)  # the new K/V at [start, start + T)
            return p.logits

    def _persists(self, p: _Plan) -> bool:
        return self.persistent and p.key.sessions == 1 and p.key.t <= persistent_mod.MAX_ROWS

    # ------------------------------------------------------------ batched forwards
    def batch_key(self, call) -> Optional[tuple[int, int]]:
        """(staged tree keys, the token count it pads to) of a call that a batched forward takes:
        graphable, no store, every logits row (the target's decode and verification steps, the
        draft's tree levels); None: it runs alone. Calls batch with others of the same staged count;
        once warm_batches has run, a call pads to the smallest warmed count at least its own."""
        t, o = call.ids.shape[0], call.opts
        if (not self.batching or o.store is not None or o.logits_rows is not None
                or not self.accepts(t, call.cache, call.mask, o)
                or call.cache.length + o.staged + t > call.cache.capacity):  # alone: its CacheFull is its own
            return None
        if self.batch_shapes is None:
            return o.staged, t
        fits = [x for s_, x in self.batch_shapes if s_ == o.staged and x >= t]
        return (o.staged, min(fits)) if fits else None

    def max_batch(self, tokens: int) -> int:
        """Sessions of `tokens` tokens each that one batched forward takes."""
        return max(1, min(MAX_BATCH_SESSIONS, padded_sessions(MAX_BATCH_ROWS // tokens + 1) // 2))

    @staticmethod
    def _batch_key(t: int, sessions: int, staged: int = 0) -> ShapeKey:
        """A batched plan always keeps the last layer's queries and LSE (one plan whichever of its
        sessions refresh retrieval this step; the capture costs a few small copies)."""
        return ShapeKey(sessions * t, sessions * staged, 0, True, False, sessions=sessions)

    def warm_batches(self, tokens: Sequence[int], max_sessions: int, staged: Sequence[int] = (0,)) -> int:
        """Captures the batched plans of `tokens` tokens a session after each count of `staged`
        tree keys, for 2, 4, ... sessions up to `max_sessions` (padded), before traffic; from then
        on a call pads to the smallest of these counts that holds it, and one that none holds runs
        alone, through its own plan: no session waits for a capture in the middle of a request
        (docs/architecture.md, "Execution plans"). Returns the plans built."""
        m = self.model
        cache = m.new_cache(ALIGN + max(staged))
        cache.length = 1  # any committed key: the build runs the forward once over it
        built = 0
        shapes = {(s_, t) for s_ in staged for t in tokens}
        for s_, t in sorted(shapes):
            nb = 2
            while nb <= min(padded_sessions(max_sessions), self.max_batch(t)):
                key = self._batch_key(t, nb, s_)
                if key not in self.plans:
                    with self.lock:
                        self._plan(key, cache)
                    built += 1
                nb *= 2
        self.batch_shapes = frozenset(shapes) | (self.batch_shapes or frozenset())
        return built

    def forward_batch(self, calls: list, tokens: int = 0) -> list:
        """The forwards of `calls` (batch_key not None, one staged count, at most max_batch(tokens)
        of them) as one forward, each session's tokens padded to `tokens` (0: the most any call has)
        with copies of its last token that attend only to themselves and are dropped; [(logits
        [t, V], Captured or None)] in order, as Decoder.forward returns. Rows: the sessions' new
        tokens, session after session; keys: every session's staged tree keys, then the new ones."""
        from specextend.models.decoder import Captured

        m = self.model
        sizes = [c.ids.shape[0] for c in calls]  # t_i
        n, t = len(calls), tokens or max(sizes)
        st = calls[0].opts.staged  # S: staged tree keys of every session
        nb = padded_sessions(n)
        if (nb > self.max_batch(t) or max(sizes) > t or any(self.batch_key(c) is None for c in calls)
                or any(c.opts.staged != st for c in calls)):
            raise ValueError(f"{n} calls of {sizes} tokens do not make one batched forward of {t} tokens a session")
        for c, ti in zip(calls, sizes):
            check_room(ti, c.cache, c.opts)
        key = self._batch_key(t, nb, st)
        dev = m.device
        mask = self._batch_mask(calls, sizes, nb, t, st)  # [rows, staged keys + new keys]
        starts = [sum(sizes[:i]) for i in range(n)]
        src = None if min(sizes) == t else to_device(  # [n * t] each padding row a copy of its last token
            [s0 + min(r, ti - 1) for s0, ti in zip(starts, sizes) for r in range(t)], torch.long, dev)
        with self.lock:
            self.forwards += 1
            self.batched_forwards += 1
            p = self._plan(key, calls[0].cache)
            ids, pos = torch.cat([c.ids for c in calls]), torch.cat([c.positions for c in calls])  # [sum t_i]
            p.ids[:n * t].copy_(ids if src is None else ids.index_select(0, src), non_blocking=True)
            p.pos[:n * t].copy_(pos if src is None else pos.index_select(0, src), non_blocking=True)
            if nb > n:  # valid ids and positions (any) for the padding sessions
                p.ids[n * t:].zero_()
                p.pos[n * t:].zero_()
            p.set_mask(mask)  # (a round like the last one: its mask is in place)
            if st:
                for i, c in enumerate(calls):  # the staged tree keys of earlier levels
                    p.scratch[:, :, :, i * st:(i + 1) * st].copy_(c.cache.staged(0, st))
            meta = [x for c in calls for x in cache_meta(c.cache.data, self.anchor, c.cache.length)]
            copy_from_host(p.meta, meta + EMPTY_META * (nb - n))
            self._replay(p)
            for i, (c, ti) in enumerate(zip(calls, sizes)):
                lo = nb * st + i * t
                c.cache.stage_all(p.scratch[:, 0, :, lo:lo + ti], p.scratch[:, 1, :, lo:lo + ti], offset=st)
            logits = p.logits.clone()  # [nb * t, V]
            out = []
            for i, (c, ti) in enumerate(zip(calls, sizes)):
                lo, cap = i * t, None
                if c.opts.capture_last:
                    cap = Captured(q=p.cap_q[:, lo:lo + ti].clone(),
                                   lse=p.cap_lse[:, lo:lo + ti].to(torch.float32, copy=True))
                out.append((logits[lo:lo + ti], cap))
            return out

    def _batch_mask(self, calls: list, sizes: list[int], nb: int, t: int, st: int) -> torch.Tensor:
        """forward_batch's mask [nb * t, nb * (st + t)]: each session's rows see its own staged keys
        and new keys through its call's mask, padding rows only themselves. Built once per
        combination of the calls' sizes and masks (a causal one, or a tree's mask tensor, which its
        users never write: tree.ancestor_mask_cached) and kept, the most recent `BATCH_MASKS`, so a
        round like an earlier one (every round of plain steps) launches nothing for it; each entry
        holds its source masks, whose ids stay theirs while it lives."""
        mkey = (nb, t, st) + tuple((ti, None if isinstance(c.mask, str) else id(c.mask)) for c, ti in zip(calls, sizes))
        hit = self._batch_masks.get(mkey)
        if hit is not None:
            self._batch_masks.move_to_end(mkey)
            return hit[0]
        dev = self.model.device
        mask = torch.zeros(nb * t, nb * (st + t), dtype=torch.bool, device=dev)  # [rows, staged keys + new keys]
        mask[:, nb * st:] = torch.eye(nb * t, dtype=torch.bool, device=dev)  # padding rows: only themselves
        for i, (c, ti) in enumerate(zip(calls, sizes)):
            own = torch.ones(ti, ti, dtype=torch.bool, device=dev).tril() if isinstance(c.mask, str) else c.mask
            lo = i * t
            mask[lo:lo + ti, i * st:(i + 1) * st] = own[:, :st]  # [ti, S] its staged keys
            mask[lo:lo + ti, nb * st + lo:nb * st + lo + ti] = own[:, st:]  # [ti, ti] its new keys
        self._batch_masks[mkey] = (mask, [c.mask for c in calls])
        if len(self._batch_masks) > BATCH_MASKS:
            self._batch_masks.popitem(last=False)
        return mask

    def _body(self, p: _Plan, steps: range | None = None) -> None:
        n = self.model.args.num_layers
        if self._persists(p):
            persistent_mod.body(self, p, steps or range(n + 1), self.persist_launch)
            return
        for i in steps or range(n + 1):
            self._segment(p, i)
            if i < n:
                self._prefix(p, i, None)

    def _prefix(self, p: _Plan, i: int, kv) -> None:
        """Layer i's queries over cache[:L] (found through p.meta) -> S partials in p.out_p / p.lse_p."""
        m = self.model
        g, d = m.args.num_kv_heads, m.args.head_dim
        rows = p.key.t * (m.args.num_heads // g)
        prefix_partials(p.q[i].view(g, rows, d), self.anchor, p.meta, i, m.scale, p.out_p, p.lse_p,
                        sessions=p.key.sessions, tokens=p.key.t // p.key.sessions)

    def _new_plan(self, key: ShapeKey, cache: KVCache) -> _Plan:
        m = self.model
        a, dev = m.args, m.device
        p = _Plan(m, key)
        g, d = a.num_kv_heads, a.head_dim
        rows = key.t * (a.num_heads // g)
        s = num_splits(rows // key.sessions, g, self.num_sms, m.dtype == torch.float32, key.sessions)
        p.out_p = torch.zeros(g, s, rows, d, dtype=torch.float32, device=dev)  # [G, S, R*T, D] partials
        p.lse_p = torch.zeros(g, s, rows, dtype=torch.float32, device=dev)  # [G, S, R*T]
        # per session: cache offset, L, capacity, 0 (cache_meta)
        p.meta = torch.zeros(4 * key.sessions, dtype=torch.int64, device=dev)
        self._set_meta(p, cache, cache.length)
        if key.sessions > 1 and self.seg.fused:  # (the fused kernel reads them; the twin reads every key)
            p.key_ranges = batch_key_ranges(key.sessions, key.t // key.sessions, key.staged // key.sessions, dev)
        if self._persists(p):
            persistent_mod.new_buffers(p, m)
        return p

    def _build(self, key: ShapeKey, cache: KVCache) -> _Plan:
        p = self._new_plan(key, cache)
        if not self.capture:
            return p
        s = self._stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up: Triton and Inductor compile, cuBLAS workspaces
            self._body(p)
        torch.cuda.current_stream().wait_stream(s)
        for steps in self.pieces:  # one pool: tensors that cross pieces (p.x, p.q) stay allocated
            graph = torch.cuda.CUDAGraph()
            with capture(graph, s, self._pool):
                self._body(p, steps)
            p.graphs.append(graph)
        return p
