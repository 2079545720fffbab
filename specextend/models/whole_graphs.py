"""Whole-forward CUDA graphs, one per (session cache, shape, key bucket): for small models.

Piecewise graphs (graphs.py) still launch one eager prefix-attention call per layer; for a small
model (the draft: 24 thin layers, six forwards per step) that host work is the whole step. Here the
entire forward is one graph. What keeps it static:
  * the prefix length L lives on the device (a [1] tensor the graph reads), and attention runs over
    a static key bucket cache[:, :B] (B = L + staged + T rounded up) with an additive mask built in
    the graph: prefix keys j < L visible, tree keys j in [L, L + n) by the tree mask, the rest not;
  * new K/V (and the retrieval store's pre-RoPE K/V) are written into the cache inside the graph
    at device slot indices (index_copy_), so a graph is bound to one cache: plans live on the cache
    object and die with the session.
The attention is dense over the bucket (one masked SDPA kernel): cheap for a draft's small working
cache, wasteful for a large target at long context, which keeps the piecewise graphs.
`capture=False` runs the same body without graphs (the twin the CPU tests compare).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F

from specextend.attention.backends import Mask
from specextend.attention.eager import compute_dtype
from specextend.kv_cache import KVCache
from specextend.models.graphs import MAX_GRAPH_TOKENS, ShapeKey, check_room, graphable

BUCKET = 512  # key-bucket granularity
BUCKETS_KEPT = 2  # per shape and cache (a working cache shrinks back after each retrieval refresh)


class _WholePlan:
    def __init__(self, model, key: ShapeKey, bucket: int):
        dev = model.device
        t, n = key.t, key.staged + key.t
        self.key, self.bucket = key, bucket
        self.ids = torch.zeros(t, dtype=torch.long, device=dev)  # [T]
        self.pos = torch.zeros(t, dtype=torch.long, device=dev)  # [T]
        self.lens = torch.zeros(2, dtype=torch.long, device=dev)  # [cache length L, store length]
        self.mask = torch.ones(t, n, dtype=torch.bool, device=dev)  # [T, staged + T]
        self.rows = torch.zeros(key.rows, dtype=torch.long, device=dev) if key.rows else None  # [R]
        self.logits: Optional[torch.Tensor] = None
        self.graph: Optional[torch.cuda.CUDAGraph] = None


def dense_bucket_attention(q, k, v, bias, scale):
    """q [H, T, D] over k, v [G, B, D] with bias [(H/G)*T, B] (0 / -inf): out [H, T, D].
    CUDA half types: one fused SDPA kernel (memory-efficient, additive mask, GQA folded into rows);
    elsewhere the same math in float32/float64 (its twin)."""
    h, t, d = q.shape
    g = k.shape[0]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        qg = q.reshape(g, (h // g) * t, d)[None]  # [1, G, R*T, D]
        out = F.scaled_dot_product_attention(qg, k[None], v[None], attn_mask=bias.to(q.dtype)[None, None],
                                             scale=scale)  # [1, G, R*T, D]
        return out.reshape(h, t, d)
    cd = compute_dtype(q.dtype)
    qg = q.reshape(g, (h // g) * t, d).to(cd)  # [G, R*T, D]
    s = torch.baddbmm(bias, qg, k.to(cd).transpose(1, 2), alpha=scale)  # [G, R*T, B]
    out = torch.bmm(torch.softmax(s, dim=-1), v.to(cd))  # [G, R*T, D]
    return out.reshape(h, t, d).to(q.dtype)


class WholeStepGraphs:
    def __init__(self, model, capture: bool = True, max_tokens: int = MAX_GRAPH_TOKENS):
        self.model = model
        self.capture = capture and model.device.type == "cuda"
        self.max_tokens = max_tokens
        self.lock = threading.Lock()
        self.forwards = 0  # forwards served (graphed, or through the twin)
        self.captures = 0  # graphs captured so far (all caches)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._stream = torch.cuda.Stream(model.device) if self.capture else None

    def accepts(self, t: int, cache: KVCache, new_mask: Mask, opts) -> bool:
        return graphable(t, cache, new_mask, opts, self.max_tokens) and not opts.capture_last

    @property
    def num_graphs(self) -> int:
        return self.captures

    def forward(self, input_ids, positions, cache: KVCache, new_mask: Mask, opts):
        t = input_ids.shape[0]
        L, end = cache.length, cache.length + opts.staged + t
        check_room(t, cache, opts)
        store = opts.store
        rows = opts.logits_rows
        key = ShapeKey(t, opts.staged, 0 if rows is None else rows.numel(), False, store is not None)
        bucket = min(cache.capacity, -(-end // BUCKET) * BUCKET)
        if isinstance(new_mask, str):
            new_mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        with self.lock:
            self.forwards += 1
            plans = cache.__dict__.setdefault("_whole_plans", {})  # (key, id(store)) -> {bucket: plan}
            per_shape = plans.setdefault((key, id(store)), OrderedDict())
            p = per_shape.get(bucket)
            fresh = p is None
            if fresh:
                p = _WholePlan(self.model, key, bucket)
            p.ids.copy_(input_ids, non_blocking=True)
            p.pos.copy_(positions, non_blocking=True)
            p.lens.copy_(torch.tensor([L, store.length if store is not None else 0]), non_blocking=True)
            p.mask.copy_(new_mask, non_blocking=True)
            if p.rows is not None:
                p.rows.copy_(rows, non_blocking=True)
            if not self.capture:
                self._body(p, cache, store)
            elif fresh:
                self._capture(p, cache, store)  # its warm-up run is this forward
                per_shape[bucket] = p
                while len(per_shape) > BUCKETS_KEPT:
                    per_shape.popitem(last=False)
            else:
                per_shape.move_to_end(bucket)
                p.graph.replay()
            return p.logits.clone(), None

    def _body(self, p: _WholePlan, cache: KVCache, store: Optional[KVCache]) -> None:
        m = self.model
        a = m.args
        t, staged, n, B = p.key.t, p.key.staged, p.key.staged + p.key.t, p.bucket
        dev = p.ids.device
        ar_t = torch.arange(t, device=dev)
        slots = p.lens[0] + staged + ar_t  # [T] cache slots of the new tokens
        rel = torch.arange(B, device=dev)[None, :] - p.lens[0]  # [1, B] key slot - L
        tree_vis = p.mask.gather(1, rel.clamp(0, n - 1).expand(t, B))  # [T, B]
        vis = (rel < 0) | ((rel < n) & tree_vis)  # prefix, or a visible tree key
        cd = compute_dtype(m.dtype)
        bias = torch.zeros(t, B, dtype=cd, device=dev).masked_fill_(~vis, float("-inf"))
        bias = bias.repeat(a.num_heads // a.num_kv_heads, 1)  # [(H/G)*T, B]
        cos, sin = m.rope.cos_sin(p.pos, m.dtype)  # [T, D]
        x = m.embed(p.ids)  # [T, E]
        for i in range(a.num_layers):
            q, k, v, k_pre = m.layer_pre(i, x, cos, sin)
            kc, vc = cache.layer(i)  # [G, S_max, D]
            kc.index_copy_(1, slots, k)
            vc.index_copy_(1, slots, v)
            if store is not None:
                sk, sv = store.layer(i)
                st_slots = p.lens[1] + ar_t
                sk.index_copy_(1, st_slots, k_pre)
                sv.index_copy_(1, st_slots, v)
            attn = dense_bucket_attention(q, kc[:, :B], vc[:, :B], bias, m.scale)
            x = m.layer_post(i, x, attn)
        p.logits = m.head(x, p.rows)

    def _capture(self, p: _WholePlan, cache: KVCache, store: Optional[KVCache]) -> None:
        """Warm-up run (this forward's real inputs: its cache writes are the ones the graph makes),
        then capture the same body."""
        s = self._stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._body(p, cache, store)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool, stream=s, capture_error_mode="thread_local"):
            self._body(p, cache, store)
        p.graph = g
        self.captures += 1
        g.replay()  # the captured body, so that p.logits is this forward's
