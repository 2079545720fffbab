"""A decode-time forward with one kernel launch per decoder layer (docs/architecture.md, "Kernels").

A tree level of the 0.5B draft (4 rows) reads ~30 MB of weights a layer, ~10 us at the copy
bandwidth, yet the fused plan (fused_layer.py) spends ~40 us on it: ten kernels, each paying its
launch, ramp and tail whatever it reads. Here one cooperative Triton kernel
(`_triton_persist.layer_kernel`) runs the whole layer: six stages of independent work items
(QKV + RoPE, prefix splits, tree part + merge, o-proj + residual, gate/up + SiLU, down + residual)
over one program per multiprocessor, a grid barrier between stages (an atomic counter per layer,
zeroed once per forward).

The twin runs the same kernel one stage per launch (`persistent=False`); tests compare it with the
fused plan and Decoder.forward_eager on the CPU (Triton's interpreter), and the persistent launch
with both on CUDA. `body` is FullStepGraphs' body for plans of at most MAX_ROWS queries.

Not in the production plan yet: correct, but its projections are slower than cuBLAS's and the
layer took 47 us against the fused plan's 38 (H100, 2026-11-26; docs/architecture.md, "Kernels",
says why and what comes next).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from specextend.attention.triton_prefix import MIN_CHUNK, config as prefix_config
from specextend.models.args import ModelArgs
from specextend.models.decoder import LayerWeights, head
from specextend.models.fused_layer import _pow2, combine_config
from specextend.models.segments import prologue

MAX_ROWS = 16  # queries per forward: one 16-row tile of the tensor-core dots
BLOCK_COLS = 16  # output columns per work item of the projections
BLOCK_K = 256  # reduction chunk of the projections  } the best of 7 tiles swept on an H100 (2026-11-26,
K_STAGES = 3  # chunks in flight per program      } benchmarks/persistent_layer.py --tiles)
NUM_WARPS = 0  # 0: the combine stage's (fused_layer.combine_config)
PER_SM = 1  # programs per multiprocessor of the cooperative launch
STAGES = 6


def supported(model) -> bool:
    """Models without QK-norm whose head dim the QKV items take, on a dtype the Triton kernels do."""
    from specextend.attention.triton_prefix import TRITON_DTYPES

    a = model.args
    return (model.dtype in TRITON_DTYPES and all(lw.q_norm is None for lw in model.w.layers)
            and a.head_dim % 2 == 0 and a.num_heads % a.num_kv_heads == 0)


def run_layer(a: ModelArgs, lw: LayerWeights, layer: int, scale: float,
              x: torch.Tensor,  # [T, E] the residual stream, updated in place
              cos: torch.Tensor, sin: torch.Tensor,  # [T, D] (Rope.cos_sin)
              q: torch.Tensor,  # [H, T, D] out: this layer's post-RoPE queries
              k_dst: torch.Tensor, v_dst: torch.Tensor,  # [G, T, D] views: the new keys (post-RoPE) and values
              kpre_dst: Optional[torch.Tensor],  # [G, T, D] pre-RoPE keys (the draft's store) or None
              anchor: torch.Tensor, meta: torch.Tensor,  # the committed cache (triton_prefix.cache_meta)
              out_p: torch.Tensor, lse_p: torch.Tensor,  # [G, S, R*T, D], [G, S, R*T] float32 scratch
              kt: torch.Tensor, vt: torch.Tensor,  # [G, n, D] tree keys (k_dst/v_dst are their tail)
              bias: torch.Tensor,  # [R*T, n] additive tree mask (tree_merge.mask_bias)
              attn: torch.Tensor,  # [T, H * D] scratch
              act: torch.Tensor,  # [T, I] scratch
              lse: Optional[torch.Tensor],  # [H, T] float32: the merged LSE out (cross-model retrieval)
              sync: torch.Tensor,  # [1] int32, zero: the grid barrier's counter
              persistent: bool = True, programs: int = 0, only: int = 0) -> None:
    """Layer `layer` of a decode-time forward. persistent: one cooperative launch of `programs`
    programs (0: one per multiprocessor); else the twin, one launch per stage (`only`: that stage
    alone, for benchmarks/persistent_layer.py)."""
    from specextend.attention._triton_kernels import INTERPRETED
    from specextend.models._triton_persist import layer_kernel

    t, e = x.shape
    h, g, d, i = a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size
    n = kt.shape[1]
    r = h // g
    s = out_p.shape[1]
    assert t <= MAX_ROWS and x.is_contiguous() and q.is_contiguous() and attn.is_contiguous() and act.is_contiguous()
    assert k_dst.stride(-1) == v_dst.stride(-1) == kt.stride(-1) == vt.stride(-1) == 1
    ieee = x.dtype == torch.float32
    pc = prefix_config(r * t, ieee, d)
    cc = combine_config(r * t, n, d, s, ieee)
    pre = kpre_dst if kpre_dst is not None else k_dst
    bqkv = lw.qkv_bias if lw.qkv_bias is not None else lw.input_norm  # unread without a bias
    args = (x, lw.input_norm, lw.qkv, bqkv, cos, sin, q, k_dst, v_dst, pre,
            k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1), pre.stride(0), pre.stride(1),
            anchor, meta, layer, out_p, lse_p, kt, vt, kt.stride(0), kt.stride(1), vt.stride(0), vt.stride(1),
            bias, attn, lse if lse is not None else attn, lw.o, lw.post_norm, lw.gate_up, act, lw.down, sync,
            a.rms_norm_eps, scale * math.log2(math.e))
    bc = BLOCK_COLS  # rotation pairs per QKV item (a head dim of 16 leaves half of them masked)
    consts = dict(T=t, E=e, H=h, G=g, D=d, DP=_pow2(d), I=i, N=n, S=s, SP=cc["sp"], BT=max(16, _pow2(t)),
                  BC=bc, BN=BLOCK_COLS, BK=BLOCK_K, PBM=pc["bm"], PBN=pc["block_n"],
                  MIN_CHUNK=-(-MIN_CHUNK // pc["block_n"]) * pc["block_n"], CBM=cc["bm"], CBN=cc["bn"],
                  DC=cc["dc"], SB=cc["sb"], HAS_BIAS=lw.qkv_bias is not None, STORE_PRE=kpre_dst is not None,
                  NEED_LSE=lse is not None, IEEE=ieee, KS=K_STAGES, INTERPRET=INTERPRETED,
                  num_warps=NUM_WARPS or cc["warps"])
    if persistent:
        progs = programs or PER_SM * torch.cuda.get_device_properties(x.device).multi_processor_count
        layer_kernel[(progs,)](*args, STAGE=-1, launch_cooperative_grid=True, **consts)
        return
    for stage, items in enumerate(stage_items(a, t, s, pc["bm"], cc["bm"], cc["dc"], bc), start=1):
        if not only or stage == only:
            layer_kernel[(items,)](*args, STAGE=stage, **consts)


def stage_items(a: ModelArgs, t: int, s: int, pbm: int, cbm: int, dc: int, bc: int) -> list[int]:
    """Work items of each stage (the kernel's N1..N6)."""
    h, g, d = a.num_heads, a.num_kv_heads, a.head_dim
    m = (h // g) * t
    cols = -(-a.hidden_size // BLOCK_COLS)
    return [(h + 2 * g) * -(-(d // 2) // bc), -(-m // pbm) * s * g, -(-m // cbm) * g * -(-d // dc),
            cols, -(-a.intermediate_size // BLOCK_COLS), cols]


def new_buffers(p, model) -> None:
    """The plan's static buffers of the persistent body (beside FullStepGraphs' own)."""
    a, dev, dt = model.args, model.device, model.dtype
    t = p.key.t
    p.pq = torch.zeros(a.num_heads, t, a.head_dim, dtype=dt, device=dev)  # [H, T, D] each layer's queries
    p.attn = torch.zeros(t, a.num_heads * a.head_dim, dtype=dt, device=dev)  # [T, H * D]
    p.act = torch.zeros(t, a.intermediate_size, dtype=dt, device=dev)  # [T, I]
    p.plse = torch.zeros(a.num_heads, t, dtype=torch.float32, device=dev)  # [H, T] last layer's merged LSE
    p.sync = torch.zeros(a.num_layers, dtype=torch.int32, device=dev)  # a barrier counter per layer


def body(graphs, p, steps: range, persistent: bool) -> None:
    """FullStepGraphs' body steps (a layer each, the last the head) with a layer per launch."""
    m = graphs.model
    n = m.args.num_layers
    for i in steps:
        if i == 0:  # the barriers' counters, then embedding, RoPE tables, tree mask
            p.sync.zero_()
            p.x, p.cos, p.sin, p.bias = prologue(m.args, m.rope, m.w.embed, p.ids, p.pos, p.mask)
        if i < n:
            layer(graphs, p, i, persistent)
            continue
        p.logits = head(m.args, m.w.norm, m.w.lm_head, p.x, p.rows)
        if p.key.capture:
            p.cap_q, p.cap_lse = p.pq, p.plse


def layer(graphs, p, i: int, persistent: bool, only: int = 0) -> None:
    """Layer i of plan p's forward (run_layer on the plan's buffers; `only`: that stage alone)."""
    m = graphs.model
    st = p.key.staged
    need_lse = p.key.capture and i == m.args.num_layers - 1
    run_layer(m.args, m.w.layers[i], i, m.scale, p.x, p.cos, p.sin, p.pq,
              p.scratch[i, 0, :, st:], p.scratch[i, 1, :, st:], None if p.store_k is None else p.store_k[i],
              graphs.anchor, p.meta, p.out_p, p.lse_p, p.scratch[i, 0], p.scratch[i, 1], p.bias,
              p.attn, p.act, p.plse if need_lse else None, p.sync[i:i + 1], persistent, graphs.num_sms, only)
