"""Compact decoder for the Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3), batch of one sequence.

One forward takes T new tokens at explicit positions, stages their K/V in the cache after its
committed prefix and attends with a mask among the new tokens (causal for prefill/decode, the
tree mask for verification and drafting). The caller commits what it keeps (see kv_cache.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from specextend.attention.backends import AttentionBackend, Mask
from specextend.attention.hybrid import layer_attention
from specextend.kv_cache import KVCache
from specextend.models.args import ModelArgs
from specextend.models.rope import Rope, apply_rope


@dataclass
class LayerWeights:
    qkv: torch.Tensor  # [(H + 2G) * D, E]
    qkv_bias: Optional[torch.Tensor]  # [(H + 2G) * D]
    o: torch.Tensor  # [E, H * D]
    q_norm: Optional[torch.Tensor]  # [D] (Qwen3)
    k_norm: Optional[torch.Tensor]  # [D]
    gate_up: torch.Tensor  # [2 * I, E]
    down: torch.Tensor  # [E, I]
    input_norm: torch.Tensor  # [E]
    post_norm: torch.Tensor  # [E]


@dataclass
class Weights:
    embed: torch.Tensor  # [V, E]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [E]
    lm_head: torch.Tensor  # [V, E] (may be the same tensor as embed)

    def to(self, device=None, dtype=None) -> "Weights":
        def cv(x):
            return None if x is None else x.to(device=device, dtype=dtype)

        tied = self.lm_head is self.embed
        embed = cv(self.embed)
        layers = [type(lw)(**{k: cv(getattr(lw, k)) for k in LayerWeights.__dataclass_fields__})
                  for lw in self.layers]  # (a folded layer stays one: fused_layer.FoldedLayerWeights)
        return Weights(embed, layers, cv(self.norm), embed if tied else cv(self.lm_head))


@dataclass
class Captured:
    """Last layer's post-RoPE queries and merged LSE of a forward (for cross-model retrieval)."""

    q: torch.Tensor  # [H, T, D]
    lse: torch.Tensor  # [H, T] float32


@dataclass
class ForwardOptions:
    hybrid: bool = True  # Hybrid Tree Attention composition (else plain masked attention)
    window: int = 0  # sliding window for every query (0 = off)
    capture_last: bool = False  # keep last layer's q and lse
    logits_rows: Optional[torch.Tensor] = None  # rows of T to compute logits for (None = all)
    store: Optional[KVCache] = field(default=None)  # also stage pre-RoPE K (and V) here
    staged: int = 0  # tree tokens already staged after the prefix (drafting deeper levels)
    graphs: bool = True  # may replay the step graphs (False: eager; a prompt's last chunk, a one-off shape)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch's fused RMSNorm (statistics in float32 or float64, one kernel on CUDA)."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


# Pure functions of one layer (the Decoder methods, graphs.py and segments.py call them).
def layer_pre(a: ModelArgs, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Norm, QKV, (QK norm), RoPE: x [T, E] -> q [H, T, D], k, v [G, T, D], pre-RoPE k [G, T, D]."""
    t = x.shape[0]
    h, g, d = a.num_heads, a.num_kv_heads, a.head_dim
    hs = rms_norm(x, lw.input_norm, a.rms_norm_eps)
    qkv = F.linear(hs, lw.qkv, lw.qkv_bias)  # [T, (H + 2G) * D]
    v = qkv[:, (h + g) * d:].view(t, g, d).transpose(0, 1)  # [G, T, D]
    if lw.q_norm is None:  # q and k rotated together
        qk = qkv[:, :(h + g) * d].view(t, h + g, d)  # [T, H + G, D]
        qk_rot = apply_rope(qk, cos[:, None], sin[:, None])  # [T, H + G, D]
        k_pre = qk[:, h:].transpose(0, 1)  # [G, T, D]
        return qk_rot[:, :h].transpose(0, 1), qk_rot[:, h:].transpose(0, 1), v, k_pre
    q = qkv[:, :h * d].view(t, h, d).transpose(0, 1)  # [H, T, D]
    k = qkv[:, h * d:(h + g) * d].view(t, g, d).transpose(0, 1)  # [G, T, D]
    q = rms_norm(q, lw.q_norm, a.rms_norm_eps)
    k = rms_norm(k, lw.k_norm, a.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, k


def layer_post(a: ModelArgs, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Output projection, residual and MLP: x [T, E], attn [H, T, D] -> x [T, E]."""
    t = x.shape[0]
    x = torch.addmm(x, attn.transpose(0, 1).reshape(t, a.num_heads * a.head_dim), lw.o.t())  # residual
    hs = rms_norm(x, lw.post_norm, a.rms_norm_eps)
    gate, up = F.linear(hs, lw.gate_up).chunk(2, dim=-1)
    return torch.addmm(x, F.silu(gate) * up, lw.down.t())


def head(a: ModelArgs, norm: torch.Tensor, lm_head: torch.Tensor, x: torch.Tensor,
         rows: Optional[torch.Tensor]) -> torch.Tensor:
    """Final norm and LM head of rows [T'] of x [T, E] -> logits [T', V] (float32 or float64)."""
    if rows is not None:
        x = x.index_select(0, rows)
    x = rms_norm(x, norm, a.rms_norm_eps)
    logits = F.linear(x, lm_head)  # [T', V]
    return logits if logits.dtype == torch.float64 else logits.float()


class Decoder:
    def __init__(self, args: ModelArgs, weights: Weights, rope: Rope, backend: AttentionBackend):
        self.args = args
        self.w = weights
        self.rope = rope.to(weights.embed.device)
        self.backend = backend
        self.scale = 1.0 / math.sqrt(args.head_dim)
        self.graphs = None  # StepGraphs (graphs.py) once enabled
        self.tree_graphs = None  # a draft's whole tree expansions as graphs (draft/tree_graph.TreeGraphs)
        self.graphed = {}  # function -> its CUDA-graph replays (models/graphed.Graphed), shared by sessions

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    def new_cache(self, capacity: int) -> KVCache:
        a = self.args
        return KVCache(a.num_layers, a.num_kv_heads, a.head_dim, capacity, self.dtype, self.device)

    # ------------------------------------------------------------ pieces (shared with graphs.py)
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.w.embed)  # [T, E]

    def layer_pre(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return layer_pre(self.args, self.w.layers[i], x, cos, sin)

    def layer_post(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return layer_post(self.args, self.w.layers[i], x, attn)

    def head(self, x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
        return head(self.args, self.w.norm, self.w.lm_head, x, rows)

    # ------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        cache: KVCache,
        new_mask: Mask,  # CAUSAL, or [T, staged + T] bool over the staged tree keys
        opts: Optional[ForwardOptions] = None,
    ) -> tuple[torch.Tensor, Optional[Captured]]:
        """Returns logits [T' , V] (float32; T' = len(logits_rows) or T) and the captured last layer.

        Small decode-time forwards go through the step graphs when enabled (graphs.py)."""
        opts = opts or ForwardOptions()
        if self.graphs is not None and self.graphs.accepts(input_ids.shape[0], cache, new_mask, opts):
            return self.graphs.forward(input_ids, positions, cache, new_mask, opts)
        return self.forward_eager(input_ids, positions, cache, new_mask, opts)

    def forward_eager(self, input_ids, positions, cache: KVCache, new_mask: Mask,
                      opts: ForwardOptions) -> tuple[torch.Tensor, Optional[Captured]]:
        """The plain forward: every op launched from Python (prefill, baselines, CPU)."""
        a = self.args
        L = cache.length
        cos, sin = self.rope.cos_sin(positions, self.dtype)  # [T, D]
        x = self.embed(input_ids)  # [T, E]
        captured = None
        for i in range(a.num_layers):
            q, k, v, k_pre = self.layer_pre(i, x, cos, sin)
            attn, cap = self.attend(i, q, k, v, k_pre, cache, L, new_mask, opts)
            captured = cap or captured
            x = self.layer_post(i, x, attn)
        return self.head(x, opts.logits_rows), captured

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre: torch.Tensor,
               cache: KVCache, prefix_len: int, new_mask: Mask,
               opts: ForwardOptions) -> tuple[torch.Tensor, Optional[Captured]]:
        """Layer i's attention of one sequence (q [H, T, D]; k, v, k_pre [G, T, D]): stages the new
        K/V (and pre-RoPE K in opts.store), attends over the cache's prefix_len committed keys plus
        the new ones; returns out [H, T, D] and, on the last layer with capture_last, the capture."""
        if opts.store is not None:
            opts.store.stage(i, k_pre, v)
        cache.stage(i, k, v, offset=opts.staged)
        kc, vc = cache.layer(i)
        need_lse = i == self.args.num_layers - 1 and opts.capture_last
        attn, lse = layer_attention(self.backend, q, kc, vc, prefix_len, new_mask, self.scale,
                                    hybrid=opts.hybrid, need_lse=need_lse, window=opts.window)
        return attn, Captured(q=q, lse=lse.float()) if need_lse else None
