"""Overlapped drafting of one draft session (docs/architecture.md, "Overlapped drafting").

After a tree is sent, the worker grows the session's candidate pool (pool.py) one background
forward at a time while the target verifies. A background forward is split in two so that the
worker thread never blocks on the device while a step may arrive:

  launch   plan the rows on the host, queue the forward over the staged tree keys, the top-k of
           its rows and a non-blocking copy of that top-k into pinned host memory, record an
           event. The forwarded nodes get their staged slots now (`mark_forwarded`): their K/V
           are written by a forward queued before anything a later step queues (stream order).
  finish   once the event has completed, add each forwarded node's children to the pool.

Between the two the nodes' children are pending in the `Flight`. A step that arrives meanwhile is
answered from the host pool at once: the re-root maps the pending nodes to their new ids and drops
those it pruned, and `finish` attaches the children to the re-rooted pool later. Only when the
new root itself is in flight (its children, the next tree's first level, are pending) does the
step wait for the forward. A step that misses drops the pool and with it the flight's result; the
flight's staged slots are overwritten by the step's own forwards, queued after it.

A flight may chain further levels on the device (`levels` > 1): each takes the best `rows`
children, by path score, of the level before (picked on the device, no host round trip between
them), so the device runs several forwards for one launch and one finish of host work. Their
nodes join the pool level by level as their events complete; a step that re-roots the pool drops
the levels not yet attached (their nodes were never in the pool; their slots were the old pool's).

A retrieval rebuild runs as a background slice too (`launch`), and never while a forward of the
same session is in flight: `launch` finishes the previous flight first, and the worker launches
only after finishing (at most one flight per worker).
"""

from __future__ import annotations

import time

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from specextend.draft.base import DraftTree
from specextend.draft.chain import Chained, chain_pick
from specextend.draft.expand import top_logprobs
from specextend.draft.pool import Pool
from specextend.kv_cache import CacheFull
from specextend.models.decoder import ForwardOptions
from specextend.models.rope import apply_rope
from specextend.models.transfer import record_event, to_device, to_host
from specextend.tree import node_depths

OVERLAP_ROWS = 8  # pool nodes forwarded per background forward
POOL_SLOTS = 128  # staged slots the pool may use (bounds one session's background work)
REFRESH_DEFER = 8  # ready steps a retrieval selection may wait for a miss before it is applied in
#                   the background (a rebuild forwards the whole pool again, and stalls its growth)
OVERLAP_LEVELS = 1  # forwards chained on the device per background launch (Chained)
OVERLAP_WIDTH = 2  # children kept per pool node, in multiples of tree_topk: the extra ones are the
#                    likely bonus tokens where the target rejects every child that was sent


@dataclass
class Flight:
    """One background slice queued on the device and not yet finished."""

    pool: Pool  # the pool whose nodes it forwards (a re-root moves it to the new pool)
    rows: list[tuple[int, int]] = field(default_factory=list)  # (top-k row, pool node): children pending
    tokens: Optional[torch.Tensor] = None  # [F, w] int64 on the host (pinned on CUDA): children's tokens
    logp: Optional[torch.Tensor] = None  # [F, w] float32 on the host: their log-probabilities
    event: Optional[torch.cuda.Event] = None  # recorded after the host copies (None on the CPU: done)
    moved: bool = False  # a re-root moved its nodes (stats: children attached late)
    held: bool = False  # tests: report not done until waited on (forces "a step arrives in flight")
    deeper: list[Chained] = field(default_factory=list)  # levels 2.. not attached yet, in order
    bases: dict[int, list[int]] = field(default_factory=dict)  # row of the last attached level -> its children's ids

    def passed(self, event: Optional[torch.cuda.Event]) -> bool:
        """The device has passed `event` (one of this flight's levels)."""
        return not self.held and (event is None or event.query())

    @property
    def last_event(self) -> Optional[torch.cuda.Event]:
        """The last level's event: in stream order, every level has finished once it has."""
        return self.deeper[-1].event if self.deeper else self.event

    def done(self) -> bool:
        return self.passed(self.last_event)

    def wait(self) -> None:
        if self.last_event is not None:
            self.last_event.synchronize()

    def may_hold(self, node: int) -> bool:
        """`node` (in the pool, not forwarded) is a candidate of the next chained level: a child of
        a row of the last level attached."""
        if self.rows or not self.deeper:
            return False
        return any(node in ids for ids in self.bases.values())

    def pending(self, node: int) -> bool:
        return any(n == node for _, n in self.rows)


def remap_rows(rows: Sequence[tuple[int, int]], ids: dict[int, int]) -> tuple[list[tuple[int, int]], int]:
    """Pending (row, node) pairs through a re-root (`ids`: old id -> new id of the nodes kept, the new
    root -> -1): the kept nodes' rows with their new ids, and the count dropped (node pruned)."""
    kept = [(r, ids[n]) for r, n in rows if ids.get(n, -1) >= 0]
    return kept, len(rows) - len(kept)


def pool_rows_mask(pool: Pool, nodes: list[int], start: int, rows: int) -> np.ndarray:
    """[rows, start + rows] bool: `nodes` forwarded at slots start.. over the staged keys (pool.mask),
    then padding rows that each see only their own slot."""
    f = len(nodes)
    mask = np.zeros((rows, start + rows), dtype=bool)
    mask[:f, :start + f] = pool.mask(nodes, start).numpy()
    pad = np.arange(f, rows)
    mask[pad, start + pad] = True
    return mask


class Overlap:
    """DraftSession's overlapped drafting (a mixin: it uses the session's caches, model and pool)."""

    def _init_overlap(self) -> None:
        self.pool: Optional[Pool] = None  # candidates below the current root
        self.flight: Optional[Flight] = None  # the background slice in flight
        self._refresh = None  # a retrieval selection to apply in the background
        self._refresh_age = 0  # ready steps since the selection waiting in _refresh first arrived
        self._restage: list[int] = []  # pool nodes to forward again after a rebuild
        self.flight_steps = 0  # steps that arrived with a background forward in flight
        self.flight_waits = 0  # ready steps that waited for it (their new root's children were in it)
        self.late_children = 0  # children attached after a re-root had moved their parent
        self.dropped_rows = 0  # pending rows dropped by a re-root (their node pruned)
        self.dropped_levels = 0  # chained levels dropped by a re-root before they were attached
        self.chained_nodes = 0  # pool nodes forwarded in chained levels
        self._settle: Optional[tuple[list[int], list[int], int]] = None  # a ready answer's K/V moves, not yet queued
        self.chains = None  # context-lookup chains for the pool (lookup_chains.LookupChains; the session sets it)

    # ------------------------------------------------------------------ background
    def launch(self) -> bool:
        """Queue one slice of overlapped drafting (a pending retrieval rebuild, then re-staging,
        then the pool's best unforwarded nodes) and leave it in flight (`self.flight`). False when
        there is nothing useful left to do. A previous flight is finished first."""
        if self.flight is not None:
            self.finish()
        self.settle()
        pool = self.pool
        if pool is None:
            return False
        try:
            if self._refresh is not None and self._refresh_age >= self.refresh_defer:
                r, self._refresh = self._refresh, None
                self._rebuild(r.chunk_ids, r.chunk_size, keep_last=True)
                self._restage = pool.unstage()  # staged K/V were for the old working cache
                self.flight = Flight(pool, event=record_event(self.model.device))  # no nodes: a rebuild
                return True
            if self._restage:
                nodes, self._restage = self._restage[:self.rows], self._restage[self.rows:]
                self.flight = self._launch_forward(nodes, children=False)
                return True
            if pool.staged + self.rows > POOL_SLOTS:
                return False
            nodes = pool.frontier(self.rows, 2 * self.params.tree.depth)
            if not nodes:
                return False
            levels = max(1, min(self.levels, (POOL_SLOTS - pool.staged) // self.rows))
            self.flight = self._launch_forward(nodes, children=True, levels=levels)
            return True
        except CacheFull:  # near the end of the request's budget: no room to draft ahead
            return False

    def flight_done(self) -> bool:
        """Nothing in flight, or it has finished on the device (then `finish` does not wait)."""
        return self.flight is None or self.flight.done()

    def finish(self) -> None:
        """Finish the slice in flight (waiting for the device if needed): attach its pending
        children to the pool, unless that pool was dropped since."""
        flight, self.flight = self.flight, None
        if flight is None:
            return
        flight.wait()
        self._attach(flight, wait=True)

    def _attach(self, flight: Flight, wait: bool = False) -> None:
        """Attach the flight's levels that have finished on the device (all of them with `wait`,
        after flight.wait()) to the pool, in order: the first level's pending children, then each
        chained level's nodes (their slots) and children. Nothing if its pool was dropped."""
        if flight.pool is not self.pool:
            return
        if flight.rows and (wait or flight.passed(flight.event)):
            rows = [r for r, _ in flight.rows]
            self._add_level(flight, [n for _, n in flight.rows], rows, flight.tokens, flight.logp)
            flight.rows = []
            if flight.moved:
                self.late_children += len(rows) * flight.tokens.shape[1]
        elif flight.rows:
            return
        while flight.deeper and flight.bases and (wait or flight.passed(flight.deeper[0].event)):
            lvl = flight.deeper.pop(0)
            w = lvl.tokens.shape[1]
            nodes, rows = [], []
            for j, (p, score) in enumerate(zip(lvl.pick.tolist(), lvl.score.tolist())):
                parent_row, c = divmod(p, w)
                if score == float("-inf") or parent_row not in flight.bases:
                    continue  # no candidate there (fewer children than rows), or a padding row's
                node = flight.bases[parent_row][c]
                self.pool.slots[node] = lvl.start + j
                nodes.append(node)
                rows.append(j)
            self.chained_nodes += len(nodes)
            self._add_level(flight, nodes, rows, lvl.tokens, lvl.logp)

    def _add_level(self, flight: Flight, nodes: list[int], rows: list[int],
                   tokens: torch.Tensor, logp: torch.Tensor) -> None:  # [R, w] each: a level's top-k
        """The children of a level's `nodes` (its top-k `rows`) join the pool; `flight.bases` maps
        each row to its children's ids (by column), where the next chained level finds its parents."""
        ids = self.pool.add_children(nodes, tokens[rows], logp[rows])
        flight.bases = dict(zip(rows, ids))

    def background(self) -> bool:
        """One slice launched and finished (synchronous: tests, warm-up)."""
        more = self.launch()
        self.finish()
        return more

    def drop_pool(self) -> None:
        """Forget the pool and its pending work. A forward in flight stays in flight (the worker
        waits for its end before launching another) but its result is dropped; its device work
        completes, in stream order, before anything queued after it."""
        self.settle()
        self.pool, self._refresh, self._restage = None, None, []
        if self.flight is not None:
            self.flight.rows, self.flight.deeper = [], []

    def _launch_forward(self, nodes: list[int], children: bool, levels: int = 1) -> Flight:
        """Queue the forward of pool nodes (their ancestors forwarded before, or earlier in `nodes`)
        as one tree level; with `children`, the top-k of each row and its copy to the host, and
        `levels` - 1 more levels chained on the device (`_chain`). Rows are padded to `rows` and the
        start slot rounded up to a multiple of it, so that the forwards take few distinct shapes
        (one CUDA graph each). Nothing here waits for the device."""
        pool, dev = self.pool, self.model.device
        start = -(-pool.staged // self.rows) * self.rows
        f, r = len(nodes), self.rows
        rows = nodes + [nodes[-1]] * (r - f)  # padding rows write to unused slots
        mask = to_device(pool_rows_mask(pool, nodes, start, r), torch.bool, dev)  # [R, start + R]
        host = [pool.tokens[i] for i in rows] + [self.work.length - 1 + pool.depths[i] for i in rows]
        ids_pos = to_device(host, torch.long, dev)  # [2R]: ids, then positions
        logits, _ = self.model.forward(ids_pos[:r], ids_pos[r:], self.work, mask, ForwardOptions(staged=start))
        pool.mark_forwarded(nodes, start, r)
        if not children:
            return Flight(pool, event=record_event(dev))
        w = OVERLAP_WIDTH * self.params.tree.topk
        top_lp, top_ids = self._graphed(top_logprobs)(logits[:r], w)  # [R, w] (padding rows too: chained levels index them)
        tokens, logp = to_host(top_ids[:f]), to_host(top_lp[:f])  # [F, w] each: valid once the event is done
        flight = Flight(pool, list(enumerate(nodes)), tokens, logp, record_event(dev))  # recorded after the copies
        if levels > 1:
            score = to_device([pool.scores[i] for i in nodes] + [float("-inf")] * (r - f), top_lp.dtype, dev)  # [R]
            flight.deeper = self._chain(levels - 1, start, mask, ids_pos[r:], score, top_lp, top_ids)
            pool.staged = start + levels * r  # their slots are taken now; their nodes join at attach
        return flight

    def _chain(self, n: int, start: int, mask: torch.Tensor,  # [R, start + R] bool, the level before's
               pos: torch.Tensor,  # [R] its positions
               score: torch.Tensor,  # [R] its rows' path scores (-inf: padding)
               top_lp: torch.Tensor, top_ids: torch.Tensor,  # [R, w] its rows' children
               ) -> list[Chained]:
        """`n` levels after the one just queued, on the device: each forwards the best R children
        of the level before by path score (EAGLE-2's level-wise expansion; the host's best-first
        order resumes at the next launch), over the level before's mask rows plus its own slot."""
        dev, r = self.model.device, self.rows
        w = top_lp.shape[1]
        pick_rows, top = self._graphed(chain_pick), self._graphed(top_logprobs)
        out = []
        for _ in range(n):
            start += r
            score, pick, ids, pos, mask = pick_rows(score, top_lp, top_ids, pos, mask, start)
            logits, _ = self.model.forward(ids, pos, self.work, mask, ForwardOptions(staged=start))
            top_lp, top_ids = top(logits[:r], w)  # [R, w]
            out.append(Chained(start, to_host(pick), to_host(score), to_host(top_ids), to_host(top_lp),
                               record_event(dev)))
        return out

    # ------------------------------------------------------------------ a step
    def _from_pool(self, step: int, accepted: Sequence[int], nodes: int) -> Optional[DraftTree]:
        """The next tree (its best `nodes`) from the pool if the accepted path and bonus token were
        forwarded in it (in flight counts: stream order), else None."""
        pool, flight = self.pool, self.flight
        path = pool.walk(accepted)
        gap = pool.first_unforwarded(path)
        t0 = time.perf_counter()
        if (gap is not None and path[gap] is not None and flight is not None and flight.pool is pool
                and flight.may_hold(path[gap])):
            # a node of the path is a candidate of the chained level in flight: wait for the flight
            self.flight_waits += 1
            self.finish()
            flight, path = None, pool.walk(accepted)
            gap = pool.first_unforwarded(path)
        if gap is not None:
            return None
        if flight is not None and flight.deeper:  # not attached: their nodes were never in this pool
            self.dropped_levels += len(flight.deeper)
            flight.deeper = []  # (still queued on the device, before anything this step queues)
        if flight is not None and flight.pending(path[-1]):
            # the new root's children (the next tree's first level) are in flight: wait for them
            self.flight_waits += 1
            self.finish()
        waited = time.perf_counter() - t0  # (the answer's flight_s)
        new, commit, keep, ids = pool.reroot_ids(path)
        self._settle = (commit, keep, pool.staged)  # the K/V moves: queued after the answer (settle;
        #                                             step_co ran the previous one first)
        self.pool, self._restage = new, []
        if self.flight is not None:  # its pending children follow their nodes into the new pool
            self.flight.rows, dropped = remap_rows(self.flight.rows, ids)
            self.flight.pool, self.flight.moved = new, True
            self.dropped_rows += dropped
        # answer with what is ready, however little: growing it now would put draft forwards back on
        # the critical path (the pool keeps growing while the target verifies this tree)
        tokens, parents = new.best_tree(nodes)
        if self.chains is not None:  # after the answer: the background extends it
            self.chains.seed(new)
        return DraftTree(step=step, tokens=tuple(tokens), parents=tuple(parents),
                         draft_cache_tokens=self.work.length + len(commit), ready=True, ahead_depth=new.ready_depth(),
                         flight_s=waited)

    def outcomes(self, step: int, m: int) -> list[tuple[tuple[int, ...], DraftTree]]:
        """A prepare's answer (base.py): the trees ready for the m likeliest verdicts, as this
        session's `step` would answer them from the pool (Pool.outcome_trees), each keyed by its
        verdict's tokens. The levels of a forward in flight that have finished join the pool first;
        nothing waits for the device."""
        if self.pool is None:
            return []
        if self.flight is not None:
            self._attach(self.flight)
        out = []
        for verdict, tokens, parents in self.pool.outcome_trees(m, self.params.tree.nodes):
            out.append((verdict, DraftTree(step=step, tokens=tuple(tokens), parents=tuple(parents),
                                           draft_cache_tokens=self.work.length + len(verdict), ready=True,
                                           ahead_depth=max(node_depths(parents)))))
        return out

    def settle(self) -> None:
        """Queue the device work of the last ready answer: its re-root's K/V moves (the accepted
        path's staged K/V committed, in the retrieval store too, the kept nodes' staged K/V
        compacted). A ready step answers before them, so that they are not on the target's wait;
        the worker runs this right after handing the answer over, and every entry point that
        touches the caches (a step, a background launch, dropping the pool) runs it first."""
        pending, self._settle = self._settle, None
        if pending is None:
            return
        commit, keep, staged_n = pending
        dev = self.work.data.device
        idx = to_device(commit + keep, torch.long, dev)  # [c + m] staged slots: committed, then kept
        staged = self.work.staged(0, staged_n)  # [layers, 2, G, staged, D]
        if self.store is not None:  # the store keeps pre-RoPE K: undo the working positions' rotation
            kv = staged.index_select(3, idx[:len(commit)])  # [layers, 2, G, c, D]
            rope = self.model.rope
            cos, sin = rope.span(self.work.length, len(commit), self.model.dtype, inverse=True)  # [c, D]
            k_pre = apply_rope(kv[:, 0], cos, sin)
            if rope.scaling != 1.0:
                k_pre = k_pre / rope.scaling ** 2
            self.store.stage_all(k_pre, kv[:, 1])
            self.store.advance(len(commit))
        self.work.commit(idx)
        self.work.truncate(self.work.length - len(keep))  # the kept nodes stay staged, at 0..m-1

    def warm_up(self) -> int:
        """Runs the overlap's forwards at every shape they take (start slots up to POOL_SLOTS), so
        that their CUDA graphs are captured before traffic. Call on a throwaway session."""
        n = 0
        for step in range(1, 4):
            while self.background():
                n += 1
            pool = self.pool
            first = next((i for i in range(len(pool)) if pool.depths[i] == 1 and pool.slots[i] >= 0), None)
            child = next((i for i in pool.children(first) if pool.slots[i] >= 0), None) if first is not None else None
            if child is None:
                break
            self.step(step, [pool.tokens[first], pool.tokens[child]], None)
        return n
