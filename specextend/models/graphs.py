"""Piecewise CUDA graphs for the small decode-time forwards (AR decode, tree verify, draft levels).

A decode-time forward is host-bound: ~75 small kernels per layer launched from Python cost more
than the weights take to stream. The only part whose shape changes from step to step is the
attention over the committed prefix (L grows). So, as vLLM's piecewise graphs do, each layer is
cut around that one call:

    seg 0      embed, RoPE tables, layer 0 pre-attention (norm, QKV, QK-norm, RoPE)
    prefix 0   eager: the LSE-returning kernel over cache[:L] (no mask)      <- variable L
    seg i      layer i-1 tree part (explicit mask over the tree keys) fused with the LSE merge,
               o-proj, MLP; then layer i pre-attention
    ...
    seg N      last layer's tail, final norm, LM head (+ the CMR query/LSE copy)

Segments are captured once per shape (T queries, tree keys, logits rows, capture, store) and
replayed; between them one eager prefix call per layer. Graphs never touch a session's KV cache
(its address differs per request): the new K/V go to a static scratch that one copy moves into the
cache after the forward, and earlier-staged tree keys (deeper draft levels) are copied into the
scratch before it. So one set of graphs serves every session of a model; a lock serializes them.

`capture=False` runs exactly the same segments without graphs: the slow twin the tests compare
with Decoder.forward_eager on any device.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from specextend.attention.backends import CAUSAL, Mask, sdpa_lse
from specextend.attention.triton_prefix import TRITON_DTYPES
from specextend.kv_cache import CacheFull, KVCache
from specextend.models import late_work
from specextend.models.capture import capture
from specextend.models.segments import Segments
from specextend.tree import ancestor_mask_cached

MAX_GRAPH_TOKENS = 64  # forwards with more queries (prefill chunks) stay eager


def graphable(t: int, cache: KVCache, new_mask: Mask, opts, max_tokens: int) -> bool:
    """HTA-composed forwards of a few queries after a non-empty prefix, no sliding window."""
    if not (opts.graphs and opts.hybrid and opts.window == 0 and cache.length > 0 and 0 < t <= max_tokens):
        return False
    return isinstance(new_mask, torch.Tensor) or new_mask == CAUSAL


def check_room(t: int, cache: KVCache, opts) -> None:
    """The CacheFull errors KVCache.stage would raise, checked before any graph writes."""
    lo = cache.length + opts.staged
    if lo + t > cache.capacity:
        raise CacheFull(f"KV cache full: {lo} + {t} > {cache.capacity}")
    if opts.store is not None and opts.store.length + t > opts.store.capacity:
        raise CacheFull(f"KV store full: {opts.store.length} + {t} > {opts.store.capacity}")


@dataclass(frozen=True)
class ShapeKey:
    t: int  # new tokens (queries)
    staged: int  # tree keys staged before this forward (deeper draft levels)
    rows: int  # logits rows (0 = all T)
    capture: bool  # keep the last layer's query and merged LSE (cross-model retrieval)
    store: bool  # also return the pre-RoPE keys (draft's retrieval store)
    sessions: int = 1  # sessions batched in the forward, t / sessions tokens each (full_graphs.py)


class _Plan:
    """Static buffers and segment graphs of one shape."""

    def __init__(self, model, key: ShapeKey):
        a, dev, dt = model.args, model.device, model.dtype
        h, g, d, t = a.num_heads, a.num_kv_heads, a.head_dim, key.t
        n = key.staged + t
        self.key = key
        self.ids = torch.zeros(t, dtype=torch.long, device=dev)  # [T]
        self.pos = torch.zeros(t, dtype=torch.long, device=dev)  # [T]
        self.mask = torch.ones(t, n, dtype=torch.bool, device=dev)  # [T, staged + T]
        self.mask_src: Optional[torch.Tensor] = None  # the tensor last copied into `mask` (forward)
        self.rows = torch.zeros(key.rows, dtype=torch.long, device=dev) if key.rows else None  # [R]
        self.scratch = torch.zeros(a.num_layers, 2, g, n, d, dtype=dt, device=dev)  # tree K/V
        self.store_k = torch.zeros(a.num_layers, g, t, d, dtype=dt, device=dev) if key.store else None
        lse_dt = torch.float64 if dt == torch.float64 else torch.float32
        self.out_p = torch.zeros(h, t, d, dtype=dt, device=dev)  # prefix attention of one layer
        self.lse_p = torch.zeros(h, t, dtype=lse_dt, device=dev)  # [H, T]
        self.q: list[Optional[torch.Tensor]] = [None] * a.num_layers  # each layer's q [H, T, D]
        self.folded = None  # GQA-folded views for the prefix call (_prefix)
        self.x: Optional[torch.Tensor] = None  # residual stream [T, E] between segments
        self.cos = self.sin = None  # [T, D]
        self.bias = None  # [(H/G) * T, staged + T] additive tree mask
        self.key_ranges: Optional[torch.Tensor] = None  # [T, 4] int32: a batched plan's (full_graphs.py)
        self.logits: Optional[torch.Tensor] = None  # [R or T, V]
        self.cap_q = self.cap_lse = None  # [H, T, D], [H, T]
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def set_mask(self, mask: torch.Tensor) -> None:
        """The forward's mask into the static buffer, unless it holds that tensor's content already (a
        shared mask, tree.ancestor_mask_cached, or a batched round's kept one, met again: in place)."""
        if self.mask_src is not mask:
            self.mask.copy_(mask, non_blocking=True)
            self.mask_src = mask


def path_mask(t: int, device) -> torch.Tensor:
    """CAUSAL over a forward's own t keys as a tensor: a path's ancestor mask (tril), one shared
    tensor per t."""
    return ancestor_mask_cached(range(-1, t - 2), device)


class StepGraphs:
    def __init__(self, model, capture: bool = True, max_tokens: int = MAX_GRAPH_TOKENS,
                 compile: bool = False, fused: bool = False, skinny: bool = False):
        self.model = model
        if fused and model.dtype not in TRITON_DTYPES:
            raise ValueError(f"the fused layer kernels take bf16, fp16 or fp32 models, not {model.dtype}")
        self.seg = Segments(compile, fused=fused, skinny=skinny)  # as written, Inductor or Triton-fused
        self.layers = model.w.layers  # the weights the segments run (folded where the loader folded them)
        self.capture = capture and model.device.type == "cuda"
        self.max_tokens = max_tokens
        self.plans: dict[ShapeKey, _Plan] = {}
        self.lock = threading.Lock()
        self.forwards = 0  # forwards served (graphed, or through the twin)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._stream = torch.cuda.Stream(model.device) if self.capture else None
        late_work.install_triton_hook()  # counts the kernels its plans compile (models/late_work.py)

    # ------------------------------------------------------------ eligibility
    def accepts(self, t: int, cache: KVCache, new_mask: Mask, opts) -> bool:
        return graphable(t, cache, new_mask, opts, self.max_tokens)

    def takes_device_length(self, t: int) -> bool:
        """Whether forward_at runs a path of t tokens after a (non-empty) committed prefix whose
        length is held on the device, without reading it (FullStepGraphs); these graphs take the
        prefix length from the host."""
        return False

    def batch_key(self, call) -> Optional[tuple]:
        """What a ForwardCall must share with others to run in one batched forward with them
        (FullStepGraphs.forward_batch); None: it runs alone. These piecewise graphs never batch."""
        return None

    def warm_batches(self, tokens, max_sessions: int) -> int:
        """Captures batched plans before traffic (FullStepGraphs); these graphs have none."""
        return 0

    def _plan(self, key: ShapeKey, cache: KVCache) -> "_Plan":
        """The plan of `key`, built the first time (compiled and captured over `cache`, any valid
        one); the caller holds the lock. Static buffers as normal tensors: updated in place from
        inference mode or not."""
        p = self.plans.get(key)
        if p is None:
            late_work.record("capture", f"{type(self).__name__} of a {self.model.args.num_layers}-layer model: {key}")
            with torch.inference_mode(False), torch.no_grad():
                p = self.plans[key] = self._build(key, cache)
        return p

    # ------------------------------------------------------------ forward
    def forward(self, input_ids, positions, cache: KVCache, new_mask: Mask, opts):
        t = input_ids.shape[0]
        L = cache.length
        check_room(t, cache, opts)
        rows = opts.logits_rows
        key = ShapeKey(t, opts.staged, 0 if rows is None else rows.numel(), opts.capture_last,
                       opts.store is not None)
        if isinstance(new_mask, str):  # CAUSAL over this forward's own keys
            new_mask = path_mask(t, input_ids.device)
        with self.lock:
            self.forwards += 1
            p = self._plan(key, cache)
            p.ids.copy_(input_ids, non_blocking=True)
            p.pos.copy_(positions, non_blocking=True)
            p.set_mask(new_mask)
            if p.rows is not None:
                p.rows.copy_(rows, non_blocking=True)
            if opts.staged:
                p.scratch[:, :, :, :opts.staged].copy_(cache.staged(0, opts.staged))
            self._run(p, cache, L)
            cache.stage_all(p.scratch[:, 0, :, opts.staged:], p.scratch[:, 1, :, opts.staged:], offset=opts.staged)
            if opts.store is not None:
                opts.store.stage_all(p.store_k, p.scratch[:, 1, :, opts.staged:])
            logits = p.logits.clone()
            captured = None
            if key.capture:
                from specextend.models.decoder import Captured

                captured = Captured(q=p.cap_q.clone(), lse=p.cap_lse.to(torch.float32, copy=True))
            return logits, captured

    def _run(self, p: _Plan, cache: KVCache, L: int) -> None:
        n = self.model.args.num_layers
        kv = cache.committed().unsqueeze(2)  # [layers, 2, 1, G, L, D]
        for i in range(n + 1):
            if self.capture:
                p.graphs[i].replay()
            else:
                self._segment(p, i)
            if i < n:
                self._prefix(p, i, kv)

    # ------------------------------------------------------------ pieces
    def _segment(self, p: _Plan, i: int) -> None:
        m = self.model
        a, w, st = m.args, m.w, p.key.staged
        layers = self.layers
        n = a.num_layers
        if i < n:
            dst = (p.scratch[i, 0, :, st:], p.scratch[i, 1, :, st:],
                   None if p.store_k is None else p.store_k[i])  # [G, T, D] each
        if i == 0:
            p.x, p.q[0], p.cos, p.sin, p.bias = self.seg.first(a, m.rope, w.embed, layers[0], p.ids,
                                                               p.pos, p.mask, *dst)
            return
        tree = (p.scratch[i - 1, 0], p.scratch[i - 1, 1], p.bias, p.out_p, p.lse_p)  # layer i-1's
        if i < n:
            p.x, p.q[i] = self.seg.mid(a, m.scale, layers[i - 1], layers[i], p.x, p.q[i - 1], *tree,
                                       p.cos, p.sin, *dst, key_ranges=p.key_ranges)
            return
        p.logits, lse = self.seg.last(a, m.scale, layers[i - 1], w.norm, w.lm_head, p.x, p.q[i - 1],
                                      *tree, p.rows, p.key.capture, key_ranges=p.key_ranges)
        if p.key.capture:
            p.cap_q, p.cap_lse = p.q[i - 1], lse

    def _prefix(self, p: _Plan, i: int, kv: torch.Tensor) -> None:
        """Eager: layer i's queries over the committed prefix kv [layers, 2, 1, G, L, D], into the
        static out_p / lse_p. The torch backend's fused LSE kernel is called directly on views made
        once per plan (this call runs once per layer: its host cost is the step's)."""
        m = self.model
        if m.backend.name != "torch":
            out, lse = m.backend.attend(p.q[i], kv[i, 0, 0], kv[i, 1, 0], None, m.scale, True)
            p.out_p.copy_(out)
            p.lse_p.copy_(lse)
            return
        g, d = m.args.num_kv_heads, m.args.head_dim
        rows = p.key.t * (m.args.num_heads // g)
        if p.folded is None or not self.capture:  # [1, G, (H/G)*T, D] views, static once captured
            p.folded = ([q.view(1, g, rows, d) for q in p.q] if self.capture else None,
                        p.out_p.view(1, g, rows, d), p.lse_p.view(1, g, rows))
        qfs, out4, lse3 = p.folded
        qf = qfs[i] if qfs is not None else p.q[i].view(1, g, rows, d)
        out, lse = sdpa_lse(qf, kv[i, 0], kv[i, 1], False, m.scale)
        out4.copy_(out)
        lse3.copy_(lse)

    def _build(self, key: ShapeKey, cache: KVCache) -> _Plan:
        p = _Plan(self.model, key)
        if not self.capture:
            return p
        n = self.model.args.num_layers
        s = self._stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up (cuBLAS handles, workspaces) off the capture
            for i in range(n + 1):
                self._segment(p, i)
        torch.cuda.current_stream().wait_stream(s)
        for i in range(n + 1):
            g = torch.cuda.CUDAGraph()
            with capture(g, s, self._pool):
                self._segment(p, i)
            p.graphs.append(g)
        return p

    @property
    def num_graphs(self) -> int:
        return sum(len(p.graphs) for p in self.plans.values())
