"""Several draft sessions' whole tree expansions as one CUDA graph (docs/architecture.md, "Draft side").

draft/tree_graph.py runs one session's expansion as one graph; with eight sessions stepping together
the draft worker replayed eight of them one after another, each paying its own launches and its own
read of the draft's weights per level. Here the sessions' expansions of one shape (TreeKey) run as
one graph: each level is one batched forward (FullStepGraphs' batched plan: rows session after
session, keys every session's staged tree keys then the new ones, a block mask), and each session's
bookkeeping (expand.level_post) runs on its own rows of the logits inside the same graph. Between
levels one gather moves every session's tree keys from the previous level's scratch into the next
level's staged slots. After the replay each session's tree keys are staged in its cache (what its
own expansion would have staged) and one read brings every pool to the host.

Sessions are padded to a power of two (full_graphs.padded_sessions) with empty caches; their rows
are computed and dropped. `capture=False` (TreeGraphs') runs the same sequence op by op: the twin
the tests compare with each session's own expansion.
"""

from __future__ import annotations

from typing import Optional

import torch

from specextend.attention.triton_prefix import cache_meta
from specextend.config import TreeConfig
from specextend.draft.expand import expand_tree_dev_co, level_post
from specextend.models.capture import capture
from specextend.models.decoder import ForwardOptions
from specextend.models.full_graphs import EMPTY_META, padded_sessions
from specextend.models.graphs import _Plan, check_room
from specextend.models.transfer import copy_from_host, to_device


class _BatchPlan:
    """Static inputs of nb sessions, one batched forward plan per level, the gathers, the pools."""

    def __init__(self, levels: list[_Plan], root: torch.Tensor, root_pos: torch.Tensor,
                 gathers: list[Optional[torch.Tensor]], final: list[torch.Tensor]):
        self.levels = levels
        self.root = root  # [nb, V] each session's root logits
        self.root_pos = root_pos  # [nb] int64: each root's position in its working cache
        self.gathers = gathers  # per level: [nb * staged] index into the previous level's scratch keys
        self.final = final  # per session: [(depth - 1) * k] index of its tree keys in the last scratch
        self.packed: Optional[torch.Tensor] = None  # [nb, 3 P + F] float64: tokens, scores, parents, forwarded
        self.sizes: tuple[int, int] = (0, 0)  # P, F
        self.depths: list[int] = []
        self.graph: Optional[torch.cuda.CUDAGraph] = None


def _key_order(nb: int, k: int, level: int) -> list[list[int]]:
    """Each session's tree keys (in level order) as indexes into the scratch of the batched forward
    of `level` (staged keys of every session first, st = level * k each, then every session's k new)."""
    st = level * k
    return [list(range(i * st, (i + 1) * st)) + list(range(nb * st + i * k, nb * st + (i + 1) * k))
            for i in range(nb)]


class TreeBatches:
    """Batched expansions of one draft model, one graph per (TreeKey, padded session count), beside
    its TreeGraphs (whose forward graphs, lock and capture setting they share)."""

    def __init__(self, trees) -> None:
        self.trees = trees  # tree_graph.TreeGraphs
        self.graphs = trees.graphs
        self.plans: dict = {}
        self.replays = 0  # batched expansions run
        self.sessions = 0  # session expansions they carried

    def takes(self, n: int, topk: int) -> bool:
        """n sessions' levels of topk rows fit one batched forward."""
        return 2 <= n and padded_sessions(n) <= self.graphs.max_batch(topk)

    def expand(self, calls: list, key) -> list:
        """Each TreeCall's pool (as TreeGraphs.expand returns it), the calls' expansions run as one;
        `key`: the TreeKey they share (tree_graph.key_of)."""
        n, k = len(calls), key.topk
        nb = padded_sessions(n)
        for c in calls:
            check_room((key.depth - 1) * k, c.cache, ForwardOptions())
        g = self.graphs
        with g.lock:
            plan = self.plans.get((key, nb))
            if plan is None:
                with torch.inference_mode(False), torch.no_grad():
                    plan = self.plans[(key, nb)] = self._build(key, nb, calls[0].cache)
            plan.root[:n].copy_(torch.stack([c.root_logits for c in calls]))
            if nb > n:
                plan.root[n:].zero_()
            copy_from_host(plan.root_pos, [c.root_pos for c in calls] + [0] * (nb - n))
            meta = [x for c in calls for x in cache_meta(c.cache.data, g.anchor, c.cache.length)]
            copy_from_host(plan.levels[0].meta, meta + EMPTY_META * (nb - n))
            if plan.graph is not None:
                plan.graph.replay()
            else:
                self._body(plan, key, nb)
            g.forwards += len(plan.levels)
            self.replays += 1
            self.sessions += n
            last = plan.levels[-1].scratch  # [layers, 2, G, nb * (staged + k), D]
            for c, idx in zip(calls, plan.final):
                keys = last.index_select(3, idx)  # [layers, 2, G, (depth - 1) * k, D]
                c.cache.stage_all(keys[:, 0], keys[:, 1], offset=0)
            vals = plan.packed[:n].tolist()
        p, f = plan.sizes
        return [([int(x) for x in v[:p]], v[p:2 * p], [int(x) for x in v[2 * p:3 * p]], list(plan.depths),
                 [int(x) for x in v[3 * p:3 * p + f]]) for v in vals]

    # ------------------------------------------------------------ build
    def _build(self, key, nb: int, cache) -> _BatchPlan:
        g, dev, k = self.graphs, self.graphs.model.device, key.topk
        levels = [g._new_plan(g._batch_key(k, nb, d * k), cache) for d in range(key.depth - 1)]
        for p in levels[1:]:
            p.meta = levels[0].meta  # every level reads the same caches at the same committed lengths
        gathers: list[Optional[torch.Tensor]] = [None] + [
            to_device([j for keys in _key_order(nb, k, d - 1) for j in keys], torch.long, dev)
            for d in range(1, key.depth - 1)]
        final = [to_device(keys, torch.long, dev) for keys in _key_order(nb, k, key.depth - 2)]
        plan = _BatchPlan(levels, torch.zeros(nb, key.vocab, dtype=key.dtype, device=dev),
                          torch.zeros(nb, dtype=torch.long, device=dev), gathers, final)
        if not self.trees.capture:
            return plan
        s = g._stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up off the capture (Triton, cuBLAS and top-k workspaces)
            self._body(plan, key, nb)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, s, self.trees._pool):
            self._body(plan, key, nb)
        plan.graph = graph
        return plan

    def _body(self, plan: _BatchPlan, key, nb: int) -> None:
        """The nb expansions, device work only: the graph's content, and the twin's sequence."""
        g, k = self.graphs, key.topk
        cos = [expand_tree_dev_co(plan.root[i], TreeConfig(k, key.depth, k), plan.root_pos[i:i + 1], level_post,
                                  key.wide) for i in range(nb)]
        asks = [next(co) for co in cos]  # each: ids [k], pos [k], mask [k, staged + k], staged
        done: list = [None] * nb
        level = 0
        while asks:
            p, st = plan.levels[level], level * k
            p.ids.copy_(torch.cat([a[0] for a in asks]))  # [nb * k]
            p.pos.copy_(torch.cat([a[1] for a in asks]))
            p.mask.zero_()  # [nb * k, nb * (st + k)]: each session's rows see its own keys only
            for i, a in enumerate(asks):
                p.mask[i * k:(i + 1) * k, i * st:(i + 1) * st] = a[2][:, :st]
                p.mask[i * k:(i + 1) * k, nb * st + i * k:nb * st + (i + 1) * k] = a[2][:, st:]
            if st:  # every session's tree keys of the levels before, from the previous level's scratch
                p.scratch[:, :, :, :nb * st].copy_(plan.levels[level - 1].scratch.index_select(3, plan.gathers[level]))
            g._body(p)
            nxt = []
            for i, co in enumerate(cos):
                try:
                    nxt.append(co.send(p.logits[i * k:(i + 1) * k]))
                except StopIteration as stop:
                    done[i] = stop.value
            assert len(nxt) in (0, nb)  # (one shape: every expansion ends at the same level)
            asks = nxt
            level += 1
        plan.packed = torch.stack([torch.cat([t.double(), s.double(), par.double(), f.double()])
                                   for t, s, par, _, f in done])  # [nb, 3 P + F]
        plan.sizes = (done[0][0].shape[0], done[0][4].shape[0])
        plan.depths = done[0][3]
