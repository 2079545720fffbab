"""Attention kernels behind one call: attend(q, k, v, mask, scale, need_lse) -> (out, lse).

mask is None (every query sees every key), CAUSAL (square causal block) or a bool tensor [T, S].
Backends:
  eager  plain math (attention_eager): the reference, any device and dtype;
  torch  PyTorch's fused SDPA kernels; where a log-sum-exp is needed, the LSE-returning ATen ops
         (flash on CPU and on CUDA half types, memory-efficient on CUDA float32), wrapped below;
  flash  the FlashAttention project's kernels (attention/flash.py: flash-attn-4 on Hopper or newer,
         else flash-attn 2) for prefill-sized calls; decode-sized calls, explicit masks, other
         dtypes and CUDA-graph captures go to `torch`. It also takes a causal block that ends the
         keys (a prefill chunk over its prefix, optionally windowed) in one call.
GQA never repeats the prefix K/V: with no mask, the H/G query heads of a group are folded into
the query-length axis so one [G, (H/G)*T, D] call covers them.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch
import torch.nn.functional as F

from specextend.attention.eager import attention_eager, compute_dtype
from specextend.attention.flash import FlashKernel, find_kernel
from specextend.attention.window import blocks_pay

log = logging.getLogger(__name__)
CAUSAL = "causal"
Mask = Union[None, str, torch.Tensor]


def causal_mask(t: int, s: int, device) -> torch.Tensor:
    """[T, S] bool, bottom-right aligned (query i sees keys up to S - T + i)."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)


def _fold_gqa(q: torch.Tensor, g: int) -> torch.Tensor:
    h, t, d = q.shape
    return q.reshape(g, (h // g) * t, d)  # [G, (H/G)*T, D]


def sdpa_lse(q4, k4, v4, is_causal: bool, scale: float):
    """LSE-returning fused SDPA, q4 [1, Hq, T, D], k4/v4 [1, Hq, S, D] -> out [1,Hq,T,D], lse [1,Hq,T]."""
    if q4.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, is_causal, scale=scale)[:2]
        return out, lse
    if q4.dtype in (torch.float16, torch.bfloat16):
        r = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, is_causal, False, scale=scale)
        return r[0], r[1]
    if q4.dtype == torch.float64:  # no fused CUDA kernel takes float64: the reference math
        mask = causal_mask(q4.shape[2], k4.shape[2], q4.device) if is_causal else None
        out, lse = attention_eager(q4[0], k4[0], v4[0], mask, scale)
        return out[None], lse[None]
    r = torch.ops.aten._scaled_dot_product_efficient_attention(
        q4, k4, v4, None, True, 0.0, is_causal, scale=scale)
    return r[0], r[1][..., : q4.shape[2]]


class AttentionBackend:
    name = "base"

    def attend(self, q, k, v, mask: Mask, scale: float, need_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError

    def takes_end_causal(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether attend_end_causal runs q [H, T, D] over k [G, S, D] in one kernel."""
        return False

    def attend_end_causal(self, q, k, v, scale: float, need_lse: bool, window: int = 0):
        """Query i of T at position S - T + i sees keys up to it (and, with window > 0, only the
        last `window` of them). Only where takes_end_causal says so; hybrid.layer_attention
        composes the same attention from the other calls everywhere else (the twin)."""
        raise NotImplementedError

    def takes_window_blocks(self, rows: int, window: int, device) -> bool:
        """Whether a windowed chunk of `rows` queries (no LSE) on `device` goes to
        window.window_blocks, in blocks of the window's length, instead of one call with an explicit
        mask (its twin)."""
        return False


class EagerBackend(AttentionBackend):
    name = "eager"

    def attend(self, q, k, v, mask, scale, need_lse):
        if isinstance(mask, str):
            mask = causal_mask(q.shape[1], k.shape[1], q.device)
        return attention_eager(q, k, v, mask, scale)


class TorchBackend(AttentionBackend):
    name = "torch"

    def takes_window_blocks(self, rows, window, device):
        # CPU only: on an H200 the blocks ran no faster than the masked call at 16K and slower at 4K
        # (docs/architecture.md, "Attention backends", *Windowed prefill in blocks*)
        return torch.device(device).type == "cpu" and blocks_pay(rows, window)

    def attend(self, q, k, v, mask, scale, need_lse):
        h, t, d = q.shape
        g = k.shape[0]
        if isinstance(mask, torch.Tensor):
            if need_lse:
                return attention_eager(q, k, v, mask, scale)
            if g != h:  # an explicit mask with grouped K/V heads (enable_gqa) would take SDPA's math
                # kernel, which writes out every score ([H, T, S]); K/V repeated per query head take its
                # fused memory-efficient kernel (docs/architecture.md, "Attention backends")
                k, v = k.repeat_interleave(h // g, dim=0), v.repeat_interleave(h // g, dim=0)
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)
            return out[0], None
        if mask is None:  # the fused kernel with the GQA fold reads each K/V once
            out, lse = sdpa_lse(_fold_gqa(q, g)[None], k[None], v[None], False, scale)
            return out.reshape(h, t, d), lse.reshape(h, t).to(compute_dtype(q.dtype)) if need_lse else None
        if not need_lse:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                                 enable_gqa=True)
            return out[0], None
        r = h // g  # causal block: repeat only the (small) new keys
        kr = k.repeat_interleave(r, dim=0)
        vr = v.repeat_interleave(r, dim=0)
        out, lse = sdpa_lse(q[None], kr[None], vr[None], True, scale)
        return out[0], lse[0].to(compute_dtype(q.dtype))


class FlashBackend(AttentionBackend):
    name = "flash"
    min_rows = 64  # below this (decode, tree verification) PyTorch's kernels and ours do better

    def __init__(self, kernel: Optional[FlashKernel] = None, min_rows: Optional[int] = None):
        self.kernel = kernel or find_kernel()
        if self.kernel is None:
            raise ValueError("attention_backend=flash needs CUDA and flash-attn-4 (extra 'flash') or flash-attn 2")
        if min_rows is not None:
            self.min_rows = min_rows
        self._fallback = TorchBackend()

    def _fast(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        return (self.kernel is not None and q.shape[1] >= self.min_rows and self.kernel.supports(q, k)
                and not (q.is_cuda and torch.cuda.is_current_stream_capturing()))

    def attend(self, q, k, v, mask, scale, need_lse):
        if isinstance(mask, torch.Tensor) or not self._fast(q, k):
            return self._fallback.attend(q, k, v, mask, scale, need_lse)
        # a square causal block: end-aligned and top-aligned causal are the same
        return self.attend_end_causal(q, k, v, scale, need_lse, causal=mask == CAUSAL)

    def takes_end_causal(self, q, k):
        return self._fast(q, k)

    def takes_window_blocks(self, rows, window, device):  # (where the kernel does not take the call)
        return self._fallback.takes_window_blocks(rows, window, device)

    def warm_up(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                windowed: bool = False) -> int:
        """Runs once each variant a prefill will call (with and without the LSE; windowed for a
        draft), so that kernels that compile at first use (flash-attn-4) do it at start-up, not in
        a request. Returns the calls made."""
        q = torch.zeros(heads, 2 * self.min_rows, head_dim, dtype=dtype, device=device)
        k = torch.zeros(kv_heads, 4 * self.min_rows, head_dim, dtype=dtype, device=device)
        if not self._fast(q, k):
            return 0
        calls = 0
        try:
            for window in (0, self.min_rows) if windowed else (0,):
                for need_lse in (False, True):
                    self.attend_end_causal(q, k, k, head_dim ** -0.5, need_lse, window)
                    calls += 1
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here must not take the server down
            log.warning("%s failed its warm-up (%s: %s); this model uses PyTorch's kernels", self.kernel.name,
                        type(e).__name__, e)
            self.kernel = None
        return calls

    def attend_end_causal(self, q, k, v, scale, need_lse, window=0, causal=True):
        out, lse = self.kernel(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, causal, window,
                               need_lse)  # [T, H, D], [H, T]
        return out.transpose(0, 1), lse


def flash_available() -> bool:
    return find_kernel() is not None


def no_cudnn_attention() -> None:
    """Turns PyTorch's cuDNN attention off, process-wide (a serving process runs only our attention).
    On Hopper PyTorch's dispatcher picks cuDNN's kernel for a masked SDPA call, and cuDNN builds an
    execution plan for every new shape: 43-85 ms a shape on an H200 with a warm driver cache, about
    0.5 s cold (benchmarks/sdpa_shapes.py, 2026-11-30). A prompt's last prefill chunk has a new row
    count nearly every request, and the draft's windowed prefill passes a mask: each draft open
    stalled that long (docs/architecture.md, "Attention backends"). The memory-efficient kernel
    builds nothing per shape and ran as fast there."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    device = torch.device(device)
    if device.type == "cuda" and name != "eager":
        no_cudnn_attention()
    if name == "auto":
        name = "flash" if device.type == "cuda" and flash_available() else "torch"
    if name == "eager":
        return EagerBackend()
    if name == "torch":
        return TorchBackend()
    if name == "flash":
        return FlashBackend()
    raise ValueError(f"unknown attention backend {name!r}")
