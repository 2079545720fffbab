"""A draft step's whole tree expansion as one CUDA graph per tree shape (docs/architecture.md,
"Execution plans").

With a forward graph per level (models/full_graphs.py) and the level's bookkeeping as another
(models/graphed.Graphed of expand.level_post), the host still did many small things per level: input copies into the
plans' static buffers, the staged tree keys copied back, the cache metadata, the graph launches,
the logits clone, the post graph's inputs and outputs. On an H200 (2026-11-26, the 0.5B draft at
16K, `benchmarks/profile_step.py` + `trace_gaps.py`) the draft step took 8.8 ms of wall time for
7.2 ms of kernels: the host, not the device, set the pace, and the device idled between levels.

Here one graph holds every level of the expansion (`expand.expand_tree_dev_co`): each level's
forward runs the full-step body (FullStepGraphs._body) on a plan of its own, its inputs written by
the previous level's bookkeeping inside the graph (frontier tokens, positions = root position +
depth, mask), the tree keys staged so far copied from the previous level's scratch. The cache
is found through one metadata tensor (address relative to the model's anchor, committed length)
written before the replay, so one graph serves every session. After the replay, one copy stages
every level's K/V in the session's cache (what the per-level forwards would have staged) and one
read brings the pool to the host.

`capture=False` runs the same sequence op by op: the slow twin the tests compare with the
per-level path (on the CPU the prefix kernel runs in Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Optional

import torch

from specextend.attention.backends import CAUSAL
from specextend.config import TreeConfig
from specextend.draft.expand import Pool, expand_tree_dev_co, level_post
from specextend.draft.tree_batch import TreeBatches
from specextend.kv_cache import KVCache
from specextend.models.capture import capture
from specextend.models.decoder import ForwardOptions
from specextend.models.graphs import ShapeKey, _Plan, check_room


@dataclass(frozen=True)
class TreeKey:
    topk: int  # frontier width: every level forwards this many rows
    depth: int  # levels of the tree (depth - 1 forwards)
    wide: int  # children kept per node (>= topk)
    vocab: int
    dtype: torch.dtype  # the root logits'


class _TreePlan:
    """Static inputs (root logits, root position), one forward plan per level, the packed pool."""

    def __init__(self, levels: list[_Plan], root: torch.Tensor, root_pos: torch.Tensor):
        self.levels = levels
        self.root = root  # [V] the root's next-token logits
        self.root_pos = root_pos  # [1] int64: the root's position in the working cache
        self.packed: Optional[torch.Tensor] = None  # [4 P] float64: tokens, scores, parents, forwarded
        self.sizes: tuple[int, int] = (0, 0)  # P (pool size), F_total (forwarded nodes)
        self.depths: list[int] = []
        self.graph: Optional[torch.cuda.CUDAGraph] = None


def key_of(call: "TreeCall") -> TreeKey:
    """The plan key of a TreeCall's expansion."""
    k = call.cfg.topk
    return TreeKey(k, call.cfg.depth, max(call.wide, k), call.root_logits.shape[-1], call.root_logits.dtype)


class TreeGraphs:
    """Tree expansions of one draft model, one graph per TreeKey, shared by its sessions (the
    forward graphs' lock serializes them with every other forward of the model)."""

    def __init__(self, graphs, capture: Optional[bool] = None):
        self.graphs = graphs  # the model's FullStepGraphs: plans, body, metadata, lock
        self.model = graphs.model
        self.capture = graphs.capture if capture is None else capture and graphs.capture
        self.plans: dict[TreeKey, _TreePlan] = {}
        self.replays = 0  # expansions run (graphed, or through the twin)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.batches = TreeBatches(self)  # several sessions' expansions of one shape as one (tree_batch.py)

    def accepts(self, cache: KVCache, cfg: TreeConfig) -> bool:
        """Trees of two levels or more, over a cache the forward graphs take."""
        return cfg.depth >= 2 and self.graphs.accepts(cfg.topk, cache, CAUSAL, ForwardOptions())

    def expand(self, cache: KVCache, root_logits: torch.Tensor,  # [V]
               cfg: TreeConfig, root_pos: int, wide: int = 0) -> Pool:
        """expand.expand_tree_co's pool, every level's K/V staged in `cache` as its forwards would."""
        k, w = cfg.topk, max(wide, cfg.topk)
        check_room((cfg.depth - 1) * k, cache, ForwardOptions())  # every level's tree keys
        key = TreeKey(k, cfg.depth, w, root_logits.shape[-1], root_logits.dtype)
        g = self.graphs
        with g.lock:
            plan = self.plans.get(key)
            if plan is None:  # static buffers as normal tensors (see graphs.StepGraphs.forward)
                with torch.inference_mode(False), torch.no_grad():
                    plan = self.plans[key] = self._build(key, cache)
            plan.root.copy_(root_logits)
            plan.root_pos.fill_(root_pos)
            g._set_meta(plan.levels[0], cache, cache.length)  # every level's (they share it)
            if plan.graph is not None:
                plan.graph.replay()
            else:
                self._body(plan, key)
            g.forwards += len(plan.levels)
            self.replays += 1
            last = plan.levels[-1].scratch  # [layers, 2, G, staged, D]: every level's new K/V
            cache.stage_all(last[:, 0], last[:, 1], offset=0)
            vals = plan.packed.tolist()
        p, f = plan.sizes
        toks = [int(x) for x in vals[:p]]
        scores = vals[p:2 * p]
        parents = [int(x) for x in vals[2 * p:3 * p]]
        forwarded = [int(x) for x in vals[3 * p:3 * p + f]]
        return toks, scores, parents, list(plan.depths), forwarded

    # ------------------------------------------------------------ build
    def _build(self, key: TreeKey, cache: KVCache) -> _TreePlan:
        g, dev = self.graphs, self.model.device
        levels = [g._new_plan(ShapeKey(key.topk, d * key.topk, 0, False, False), cache)
                  for d in range(key.depth - 1)]
        for p in levels[1:]:
            p.meta = levels[0].meta  # one cache, one committed length for the whole expansion
        plan = _TreePlan(levels, torch.zeros(key.vocab, dtype=key.dtype, device=dev),
                         torch.zeros(1, dtype=torch.long, device=dev))
        if not self.capture:
            return plan
        s = g._stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up off the capture (Triton, cuBLAS and top-k workspaces)
            self._body(plan, key)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, s, self._pool):
            self._body(plan, key)
        plan.graph = graph
        return plan

    def _body(self, plan: _TreePlan, key: TreeKey) -> None:
        """The expansion, device work only: the graph's content, and the twin's sequence."""
        g = self.graphs
        co = expand_tree_dev_co(plan.root, TreeConfig(key.topk, key.depth, key.topk), plan.root_pos,
                                level_post, key.wide)
        try:
            ids, pos, mask, staged = next(co)
            while True:
                p = plan.levels[staged // key.topk]
                p.ids.copy_(ids)
                p.pos.copy_(pos)
                p.mask.copy_(mask)
                if staged:  # the tree keys of the levels before, from the previous level's scratch
                    p.scratch[:, :, :, :staged].copy_(plan.levels[staged // key.topk - 1].scratch)
                g._body(p)
                ids, pos, mask, staged = co.send(p.logits)
        except StopIteration as stop:
            toks, scores, parents, depths, forwarded = stop.value
        plan.packed = torch.cat([toks.double(), scores.double(), parents.double(), forwarded.double()])
        plan.sizes = (toks.shape[0], forwarded.shape[0])
        plan.depths = depths


@dataclass
class TreeCall:
    """A draft step's whole expansion as one request to its driver (DraftSession yields it where it
    would yield a forward per level). Alone it runs as one TreeGraphs expansion; a driver that
    batches several sessions' levels instead runs `levels()`, the same expansion as per-level
    ForwardCalls (draft/batch.py)."""

    graphs: TreeGraphs
    cache: KVCache
    root_logits: torch.Tensor  # [V]
    cfg: TreeConfig
    root_pos: int
    wide: int
    levels: Callable[[], Generator]  # -> the per-level coroutine, returning the same pool

    def run(self, model) -> Pool:
        return self.graphs.expand(self.cache, self.root_logits, self.cfg, self.root_pos, self.wide)
