"""The graph segments of a decode-time forward as pure functions of tensors (graphs.py runs them).

    first  embed, RoPE tables, additive tree mask, layer 0 pre-attention
    mid    layer i-1's tree part fused with the LSE merge, o-proj, MLP; layer i pre-attention
    last   the last layer's tail, final norm, LM head (+ the merged LSE for cross-model retrieval)

Each writes its layer's new K/V (and pre-RoPE K for the draft's store) into the static scratch
views it is given and returns the rest. Weights arrive as arguments, never as globals, so one
compiled version of `mid` serves every layer of a model (Segments(compile=True): Inductor fuses
the ~20 small elementwise kernels of a layer into a few; the plain functions are its slow twin).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from specextend.attention.eager import compute_dtype
from specextend.attention.tree_merge import mask_bias, tree_attention_merged
from specextend.models import fused_layer
from specextend.models.args import ModelArgs
from specextend.models.decoder import LayerWeights, head, layer_post, layer_pre
from specextend.models.rope import Rope


def _pre(a: ModelArgs, lw: LayerWeights, x, cos, sin, k_dst, v_dst, kpre_dst) -> torch.Tensor:
    """Layer pre-attention; k, v -> k_dst, v_dst [G, T, D] (pre-RoPE k -> kpre_dst); q [H, T, D]."""
    q, k, v, k_pre = layer_pre(a, lw, x, cos, sin)
    k_dst.copy_(k)
    v_dst.copy_(v)
    if kpre_dst is not None:
        kpre_dst.copy_(k_pre)
    return q.contiguous()  # contiguous: the prefix call's GQA fold is then a view


def _layer_pre(a: ModelArgs, lw: LayerWeights, x, cos, sin, k_dst, v_dst, kpre_dst, fused: bool,
               skinny: bool = False) -> torch.Tensor:
    """_pre, or with RoPE and the copies in one Triton kernel (QK-norm models keep the torch path);
    `skinny`: the norm and QKV projection in one kernel too (skinny.py)."""
    if fused and lw.q_norm is None:
        return fused_layer.layer_pre(a, lw, x, cos, sin, k_dst, v_dst, kpre_dst, skinny)
    return _pre(a, lw, x, cos, sin, k_dst, v_dst, kpre_dst)


def _attend_post(a: ModelArgs, scale: float, lw: LayerWeights, x, q, kt, vt, bias, out_p, lse_p,
                 need_lse: bool, fused: bool, skinny: bool = False, key_ranges: Optional[torch.Tensor] = None):
    """HTA's tree part merged with the prefix part, then o-proj and MLP -> x [T, E], lse or None.
    `key_ranges` [T, 4]: a batched forward's per-token key ranges (the fused kernel reads only those)."""
    if fused:  # one Triton kernel for the attention, written in the o-proj's layout
        attn, lse = fused_layer.tree_combine(q, kt, vt, bias, out_p, lse_p, scale, need_lse,
                                             key_ranges=key_ranges)  # [T, H*D]
        return fused_layer.layer_post(a, lw, x, attn, skinny), lse
    attn, lse = tree_attention_merged(q, kt, vt, bias, out_p, lse_p, scale, need_lse=need_lse)  # [H, T, D]
    return layer_post(a, lw, x, attn), lse


def first(a: ModelArgs, rope: Rope, embed: torch.Tensor, lw: LayerWeights,
          ids: torch.Tensor,  # [T]
          pos: torch.Tensor,  # [T]
          mask: torch.Tensor,  # [T, staged + T] bool
          k_dst: torch.Tensor, v_dst: torch.Tensor, kpre_dst: Optional[torch.Tensor], fused: bool = False,
          skinny: bool = False):
    """-> x [T, E], q [H, T, D], cos, sin [T, D], bias [(H/G) * T, staged + T]."""
    x, cos, sin, bias = prologue(a, rope, embed, ids, pos, mask)
    q = _layer_pre(a, lw, x, cos, sin, k_dst, v_dst, kpre_dst, fused, skinny)
    return x, q, cos, sin, bias


def prologue(a: ModelArgs, rope: Rope, embed: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
             mask: torch.Tensor):
    """A forward's inputs -> x [T, E], cos, sin [T, D], the additive tree mask [(H/G) * T, staged + T]
    (also the persistent body's first step, persistent.py)."""
    dt = embed.dtype
    cos, sin = rope.cos_sin(pos, dt)
    bias = mask_bias(mask, a.num_heads // a.num_kv_heads, compute_dtype(dt))
    return F.embedding(ids, embed), cos, sin, bias


def mid(a: ModelArgs, scale: float, lw_prev: LayerWeights, lw: LayerWeights,
        x: torch.Tensor,  # [T, E]
        q_prev: torch.Tensor,  # [H, T, D] layer i-1's queries
        kt: torch.Tensor, vt: torch.Tensor,  # [G, staged + T, D] layer i-1's tree keys
        bias: torch.Tensor,
        out_p: torch.Tensor, lse_p: torch.Tensor,  # [H, T, D], [H, T] layer i-1's prefix part
        cos: torch.Tensor, sin: torch.Tensor,
        k_dst: torch.Tensor, v_dst: torch.Tensor, kpre_dst: Optional[torch.Tensor], fused: bool = False,
        skinny: bool = False, key_ranges: Optional[torch.Tensor] = None):
    """-> x [T, E] after layer i-1, q [H, T, D] of layer i."""
    x, _ = _attend_post(a, scale, lw_prev, x, q_prev, kt, vt, bias, out_p, lse_p, False, fused, skinny, key_ranges)
    return x, _layer_pre(a, lw, x, cos, sin, k_dst, v_dst, kpre_dst, fused, skinny)


def last(a: ModelArgs, scale: float, lw_prev: LayerWeights, norm: torch.Tensor, lm_head: torch.Tensor,
         x, q_prev, kt, vt, bias, out_p, lse_p,
         rows: Optional[torch.Tensor],  # [R] logits rows (None = all)
         need_lse: bool, fused: bool = False, skinny: bool = False, key_ranges: Optional[torch.Tensor] = None):
    """-> logits [R or T, V] (float32/64), merged lse [H, T] of the last layer (or None)."""
    x, lse = _attend_post(a, scale, lw_prev, x, q_prev, kt, vt, bias, out_p, lse_p, need_lse, fused, skinny,
                          key_ranges)
    return head(a, norm, lm_head, x, rows), lse


class Segments:
    """The three segment functions, as written (the twin), compiled by torch.compile/Inductor, or
    with their small kernels replaced by the Triton kernels of fused_layer.py (`fused`).

    Shapes change only with the plan (T, staged keys, rows): the first new shape after the first
    compile recompiles once with dynamic sizes; recompiles happen in a plan's warm-up, never
    inside a graph capture."""

    def __init__(self, compile: bool = False, backend: str = "inductor", fused: bool = False, skinny: bool = False):
        if compile and fused:
            raise ValueError("fused layer kernels and torch.compile are alternatives: pick one")
        if skinny and not fused:
            raise ValueError("the skinny linear kernels come with the fused layer kernels")
        self.compiled, self.fused, self.skinny = compile, fused, skinny
        if fused:
            self.first, self.mid, self.last = (functools.partial(f, fused=True, skinny=skinny)
                                               for f in (first, mid, last))
        elif compile:
            import torch._dynamo

            # Every model, dtype and shape family in the process compiles its own entries of the
            # same three code objects (target and draft, AR and tree shapes, their first static
            # then dynamic versions): with fullgraph=True, passing the limit is an error, not a
            # fallback (a CUDA test process with eight decoders passed 32; 2026-11-22).
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, 512)
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4096)
            opts = dict(fullgraph=True, backend=backend)
            self.first = torch.compile(first, **opts)
            self.mid = torch.compile(mid, **opts)
            self.last = torch.compile(last, **opts)
        else:
            self.first, self.mid, self.last = first, mid, last
