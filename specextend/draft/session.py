"""One request's state on the draft side: caches, retrieval selection, tree drafting, and the
overlapped drafting pool (docs/architecture.md, "Draft side").

Caches: `work` is the working cache the draft attends over (rotated K, positions renumbered
0..W-1); with retrieval on, `store` keeps every committed token's pre-RoPE K and its V at true
positions, and the working cache is rebuilt from it when a new selection arrives. Without
retrieval the working cache is simply the full cache. Tree nodes' K/V are staged after the
committed tokens and never committed by the draft's own forwards.

With overlap on, the session keeps the candidate pool of its last tree (pool.py) and the worker
grows it between steps (overlap.py: `launch` queues one forward, `finish` adds its results). A
step whose accepted path and bonus token were already forwarded in the pool is answered from it at
once: their K/V move from staged to committed slots (one gather), the pool is re-rooted at the
bonus token, and its best nodes are the tree. Any other step drops the pool and drafts as without
overlap. A retrieval refresh that arrives with a ready tree is applied after the answer, in the
background. Host data reaches the device through pinned memory (models/transfer.py): nothing here
waits for queued device work but the final read of a drafted tree.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Generator, Optional, Sequence

import torch

from specextend.attention.backends import CAUSAL
from specextend.config import TreeConfig
from specextend.draft.base import DraftError, DraftSessionParams, DraftTree, Retrieval, TreeBound
from specextend.draft.expand import Level, expand_tree_co, level_post
from specextend.draft.overlap import (OVERLAP_LEVELS, OVERLAP_ROWS, OVERLAP_WIDTH, POOL_SLOTS,  # noqa: F401
                                      REFRESH_DEFER, Overlap)
from specextend.draft.lookup_chains import LookupChains
from specextend.draft.pool import Pool
from specextend.draft.tree_graph import TreeCall, TreeGraphs
from specextend.models.batch import ForwardCall, Result, run_alone
from specextend.models.decoder import Decoder, ForwardOptions
from specextend.models.full_graphs import FullStepGraphs
from specextend.models.graphed import Graphed
from specextend.models.rope import apply_rope
from specextend.models.transfer import to_device
from specextend.prefix_cache import PrefixCache
from specextend.retrieval import chunk_positions, initial_chunks
from specextend.tree import reindex_tree, select_best_nodes

# Defaults from H200x2 runs (benchmarks/README.md): 8 rows per background forward (OVERLAP_ROWS)
# beat 16 at 8K and 16K (2026-11-23); one level drafted on a miss beat three (2026-11-26,
# benchmarks/overlap_sweep.py, real pair, fixed trees: 0.95x against 0.82x `ar` at 16K, 0.85x
# against 0.78x at 30K): a miss answers after the catch-up forward with the root's children, the
# background deepens the pool while the target verifies them.
CATCH_UP = 64  # rows of a catch-up forward (the graphs' largest: models/graphs.MAX_GRAPH_TOKENS)
SYNC_DEPTH = 1  # levels drafted before answering a step that found nothing ready (0: the tree's depth)

_POST_LOCK = threading.Lock()


class SectionTimer:
    """Time spent in a section of the draft's work, on its device's clock: CUDA events recorded on
    the path (no synchronisation there), read when asked (e.g. at close); the host clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (start, end) of each section
        self._host_s = 0.0
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._host_s += time.perf_counter() - self._start

    def seconds(self) -> float:
        for _, end in self._events[-1:]:
            end.synchronize()
        return self._host_s + sum(a.elapsed_time(b) for a, b in self._events) / 1e3


class DraftSession(Overlap):
    expand_co = staticmethod(expand_tree_co)  # the tree search (expand_tree_host_co: its twin)

    def __init__(self, model: Decoder, prompt_ids: Sequence[int], params: DraftSessionParams,
                 prefill_chunk: int = 2048, overlap: bool = False, overlap_rows: int = OVERLAP_ROWS,
                 sync_depth: int = SYNC_DEPTH, overlap_levels: int = OVERLAP_LEVELS,
                 refresh_defer: int = REFRESH_DEFER, prefix: Optional[PrefixCache] = None):
        self.model = model
        self.rows = overlap_rows
        self.levels = overlap_levels  # forwards per background launch (chain.py, Chained)
        self.refresh_defer = refresh_defer  # ready steps a selection waits for a miss (0: apply in the background)
        # with overlap, a step that finds nothing ready drafts only this deep before answering (0: the
        # tree's depth); the background deepens the pool while the target verifies
        self.sync_depth = sync_depth
        self.params = params
        self.cfg = params.retrieval
        self.overlap = overlap
        tree = params.tree
        # room for what a step stages past the committed tokens, and for a catch-up's padding: a catch-up
        # without room for CATCH_UP rows runs unpadded, a graph shape per token count captured on the
        # request's path (every catch-up of a request of few tokens did, before this room was kept)
        extra = params.max_new_tokens + tree.depth * tree.topk + tree.depth + 8 + CATCH_UP
        if overlap:
            extra += POOL_SLOTS + 2 * overlap_rows
        self.work = model.new_cache(len(prompt_ids) + extra)
        self.store = model.new_cache(len(prompt_ids) + extra) if self.cfg.enabled else None
        self.refreshes = 0
        self.rebuild_timer = SectionTimer(model.device)  # the working cache's rebuilds (bench: signal cost)
        self._behind: Optional[tuple] = None  # an unready answer's catch-up, run by settle (_miss_co's arguments)
        self._broken: Optional[BaseException] = None  # that catch-up failed: the session cannot draft on
        self._init_overlap()  # pool, flight, pending refresh (overlap.py)
        if overlap and params.lookup_tokens:  # context-lookup chains put into the pool (lookup_chains.py)
            self.chains = LookupChains(prompt_ids, model.args.vocab_size, params.lookup_tokens,
                                       capacity=len(prompt_ids) + params.max_new_tokens + 1)
        self._prefill(list(prompt_ids), prefill_chunk, prefix)

    # ----------------------------------------------------------------- caches
    def forward_committed(self, ids: list[int], window: int = 0, rows: int = 0, graphs: bool = True) -> torch.Tensor:
        """Forward committed tokens in place (`_forward_committed_co`): the last one's logits [V]."""
        return run_alone(self._forward_committed_co(ids, window, rows, graphs), self.model)

    def _forward_committed_co(self, ids: list[int], window: int = 0, rows: int = 0,
                              graphs: bool = True) -> Generator[ForwardCall, Result, torch.Tensor]:
        """Forward committed tokens (causal), append them to both caches; logits of the last [V].
        `rows` > len(ids): padded to that many rows with copies of the last token, whose K/V are
        staged past the committed ones and never committed (one graph shape for any count).
        `graphs=False`: eager (a prompt's last chunk: any length, seen once)."""
        dev = self.model.device
        t = len(ids)
        rows = max(rows, t)
        pos = torch.arange(self.work.length, self.work.length + rows, device=dev)  # [rows]
        ids_last = to_device(ids + ids[-1:] * (rows - t) + [t - 1], torch.long, dev)  # [rows + 1]: ids, then the row to read
        logits, _ = yield ForwardCall(ids_last[:rows], pos, self.work, CAUSAL,
                                      ForwardOptions(window=window, store=self.store, logits_rows=ids_last[rows:],
                                                     graphs=graphs))
        self.work.advance(t)
        if self.store is not None:
            self.store.advance(t)
        return logits[0]

    def _catch_up_co(self, ids: list[int]) -> Generator[ForwardCall, Result, torch.Tensor]:
        """Forward more tokens than a step can accept (the target's plain steps' tokens, any count)
        in chunks padded to CATCH_UP rows: one graph shape, captured at warm-up, instead of a
        capture per count in the middle of a request (docs/architecture.md, "Execution plans")."""
        if not self.pads_catch_up(self.model):
            return (yield from self._forward_committed_co(ids))
        for lo in range(0, len(ids), CATCH_UP):
            chunk = ids[lo:lo + CATCH_UP]
            room = min(self.work.capacity - self.work.length,
                       CATCH_UP if self.store is None else self.store.capacity - self.store.length)
            logits = yield from self._forward_committed_co(chunk, rows=CATCH_UP if room >= CATCH_UP else 0)
        return logits

    def _prefill(self, prompt: list[int], chunk: int, prefix: Optional[PrefixCache] = None) -> None:
        """Chunked prefill of both caches; with `prefix`, from the longest cached run of whole chunks
        (both caches' K/V: the working cache's and the store's pre-RoPE keys), kept for later
        prompts before retrieval prunes the working cache (docs/architecture.md, "Prefix caching")."""
        caches = (self.work,) if self.store is None else (self.work, self.store)
        start = prefix.load(prompt, *caches) if prefix is not None else 0
        for lo in range(start, len(prompt), chunk):
            self.forward_committed(prompt[lo:lo + chunk], window=self.cfg.draft_prefill_window or 0, graphs=False)
        if prefix is not None:
            prefix.store(prompt, *caches)
        if self.store is not None and len(prompt) > self.cfg.budget_tokens:
            self._rebuild(initial_chunks(len(prompt), self.cfg), self.cfg.chunk_size)

    def _rebuild(self, chunk_ids: Sequence[int], chunk_size: int, keep_last: bool = False) -> None:
        """Working cache := the stored tokens of the selected chunks, re-rotated at 0..W-1 (and the
        last stored token when `keep_last`: the root, committed after the selection was made)."""
        self.rebuild_timer.start()
        pos = chunk_positions(chunk_ids, chunk_size, self.store.length)  # [W]
        last = self.store.length - 1
        if keep_last and (pos.numel() == 0 or int(pos[-1]) != last):
            pos = torch.cat([pos, torch.tensor([last])])
        pos = to_device(pos, torch.long, self.model.device)
        kv = self.store.data.index_select(3, pos)  # [layers, 2, G, W, D]
        cos, sin = self.model.rope.span(0, pos.numel(), self.model.dtype)  # [W, D]
        self.work.load(apply_rope(kv[:, 0], cos, sin), kv[:, 1])
        self.rebuild_timer.stop()
        self.refreshes += 1

    @staticmethod
    def pads_catch_up(model: Decoder) -> bool:
        """Catch-up forwards padded to one shape: with CUDA graphs (eager ones capture nothing)."""
        return model.graphs is not None

    @property
    def cache_tokens(self) -> int:
        return self.work.length

    # ----------------------------------------------------------------- step
    def step(self, step: int, accepted_tokens: Sequence[int], retrieval: Optional[Retrieval],
             bound: Optional[TreeBound] = None) -> DraftTree:
        """Commit the accepted tokens (the last is the next root) and draft the next tree, within
        `bound` (this step's cap from the target's adaptive policy, base.py) if given."""
        tree = run_alone(self.step_co(step, accepted_tokens, retrieval, bound), self.model)
        self.settle()
        return tree

    def step_co(self, step: int, accepted_tokens: Sequence[int], retrieval: Optional[Retrieval],
                bound: Optional[TreeBound] = None) -> Generator[ForwardCall, Result, DraftTree]:
        """`step` as a coroutine: yields each forward it needs (ForwardCall), is sent its result,
        returns the tree. The worker drives several sessions' steps at once, their forwards
        batched (draft/batch.py); alone, `run_alone` runs each forward as it comes."""
        shape = (bound or TreeBound()).apply(self.params.tree)  # this step's nodes and depth
        if not accepted_tokens:
            raise ValueError("a step needs at least the bonus token")
        self.settle()
        if self._broken is not None:
            raise DraftError(f"the draft session could not catch up: {self._broken!r}")
        if self.chains is not None:
            self.chains.accepted(accepted_tokens)
        refresh = retrieval is not None and self.store is not None and bool(retrieval.chunk_ids)
        if self.flight is not None:  # a background forward: finished (cheap), or still in flight
            if self.flight.done():
                self.finish()
            else:
                self.flight_steps += 1
                self._attach(self.flight)  # its levels that have finished join the pool
        if self.pool is not None:
            ready = self._from_pool(step, accepted_tokens, shape.nodes)
            if ready is not None:
                if refresh:  # the newest selection waits for the next miss (or REFRESH_DEFER ready steps)
                    self._refresh_age = 0 if self._refresh is None else self._refresh_age + 1
                    self._refresh = retrieval
                elif self._refresh is not None:
                    self._refresh_age += 1
                return ready
        if not refresh and self._refresh is not None:  # a selection still waiting: apply it now
            retrieval, refresh = self._refresh, True
        # a miss: the pool goes, with the result of a forward still in flight (its staged slots are
        # overwritten by this step's forwards, queued after it on the device)
        self.drop_pool()
        behind = (list(accepted_tokens), retrieval if refresh else None, shape)
        if self.overlap and bound is not None and bound.ready_only:
            # nothing ready: an empty tree at once (the target decodes one token plainly); the
            # catch-up and the first level run right after the answer (settle), then the background
            self._behind = behind
            return DraftTree(step=step, tokens=(), parents=(), draft_cache_tokens=self.work.length)
        tokens, parents = yield from self._miss_co(*behind)
        return DraftTree(step=step, tokens=tuple(tokens), parents=tuple(parents),
                         draft_cache_tokens=self.work.length)

    def _miss_co(self, accepted: list[int], retrieval: Optional[Retrieval],
                 shape: TreeConfig) -> Generator[ForwardCall, Result, tuple[list[int], list[int]]]:
        """A step that found nothing ready: apply the selection, forward the accepted tokens (the
        last is the root), draft the tree (with overlap its pool is what the background grows)."""
        if retrieval is not None:
            self._rebuild(retrieval.chunk_ids, retrieval.chunk_size)
        root_logits = yield from (self._forward_committed_co(accepted) if len(accepted) <= self.params.tree.depth + 1
                                  else self._catch_up_co(accepted))
        return (yield from self._draft_tree_co(root_logits, shape))

    def settle(self) -> None:
        """The device work a step's answer left for after it: a ready answer's K/V moves
        (Overlap.settle), or an unready answer's catch-up and first level (`_miss_co`). The worker
        runs it right after handing the answer over; every entry point that touches the caches runs
        it first. A catch-up that fails leaves the session unusable: its next step raises."""
        super().settle()
        behind, self._behind = self._behind, None
        if behind is not None:
            try:
                run_alone(self._miss_co(*behind), self.model)
            except BaseException as exc:
                self._broken = exc
                raise

    def _post(self):
        """The expansion's per-level bookkeeping: CUDA graphs where the model's forwards are graphed
        (made once per model, shared by its sessions), else op by op."""
        return self._graphed(level_post)

    def _graphed(self, fn):
        """`fn` (a function of device tensors, models/graphed.py) replayed as CUDA graphs where the
        model's forwards are captured (made once per model, shared by its sessions), else `fn`."""
        m = self.model
        if m.graphs is None or not m.graphs.capture:
            return fn
        with _POST_LOCK:
            if fn not in m.graphed:
                m.graphed[fn] = Graphed(fn, m.device)
        return m.graphed[fn]

    def _tree_graphs(self, tree: TreeConfig) -> Optional[TreeGraphs]:
        """The model's whole-expansion graphs (made once per model where its forwards are captured
        full-step graphs, shared by its sessions) if they take this tree; None: a forward per level."""
        m = self.model
        if self.expand_co is not expand_tree_co:  # the host twin drafts level by level
            return None
        if m.tree_graphs is None:
            if not (isinstance(m.graphs, FullStepGraphs) and m.graphs.capture):
                return None
            with _POST_LOCK:
                if m.tree_graphs is None:
                    m.tree_graphs = TreeGraphs(m.graphs)
        return m.tree_graphs if m.tree_graphs.accepts(self.work, tree) else None

    def _draft_tree_co(self, root_logits: torch.Tensor,
                       shape: TreeConfig) -> Generator[ForwardCall, Result, tuple[list[int], list[int]]]:
        """Dynamic tree (EAGLE-2 style, draft/expand.py) `shape.depth` deep, then the best
        `shape.nodes` of its pool."""
        tree, wide = shape, 0
        if self.overlap:
            wide = OVERLAP_WIDTH * tree.topk
            if 0 < self.sync_depth < tree.depth:
                tree = replace(tree, depth=self.sync_depth)
        root_pos = self.work.length - 1

        def levels():  # the expansion as a forward per level
            return self._levels(self.expand_co(root_logits, tree, root_pos, post=self._post(), wide=wide))
        graphs = self._tree_graphs(tree)
        if graphs is not None:  # one graph for every level (draft/tree_graph.py)
            toks, scores, parents, depths, forwarded = yield TreeCall(graphs, self.work, root_logits, tree,
                                                                      root_pos, wide, levels)
        else:
            toks, scores, parents, depths, forwarded = yield from levels()
        if self.overlap:
            self.pool = Pool.from_expansion(toks, scores, parents, depths, forwarded)
            if self.chains is not None:  # below the answer's nodes: the background extends it
                self.chains.seed(self.pool)
        chosen = select_best_nodes(scores, depths, parents, shape.nodes)
        return reindex_tree(chosen, toks, parents)

    def _levels(self, co: Generator[Level, torch.Tensor, object]) -> Generator[ForwardCall, Result, object]:
        """An expansion coroutine's levels as forwards over the working cache (tree keys staged)."""
        try:
            level = next(co)
            while True:
                ids, positions, mask, staged = level
                logits, _ = yield ForwardCall(ids, positions, self.work, mask, ForwardOptions(staged=staged))
                level = co.send(logits)
        except StopIteration as stop:
            return stop.value
