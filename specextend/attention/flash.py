"""The FlashAttention project's kernels behind one contract (docs/architecture.md, "Attention backends").

Two releases install as the `flash_attn` package: flash-attn 2 (`flash_attn.flash_attn_func`, a CUDA
build from source) and flash-attn-4 (`flash_attn.cute.flash_attn_func`, CuTe-DSL kernels for Hopper and
Blackwell that install as wheels and compile at first use). Both take [B, S, heads, D] tensors with
any strides whose last dimension is contiguous, grouped K/V heads (GQA), a causal flag that aligns
the queries to the *end* of the keys (query i of T sees keys up to S - T + i), a left window, and
return the log-sum-exp of each row (natural log, [B, H, T]). `FlashKernel` wraps either as

    kernel(q [T, H, D], k [S, G, D], v [S, G, D], scale, causal, window, need_lse)
        -> out [T, H, D], lse [H, T] float32 or None

`reference_kernel` is the same contract in plain math (its slow twin; the CPU tests drive the
backend's layout handling through it, the GPU tests compare the real kernels with it).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from specextend.attention.eager import attention_eager

log = logging.getLogger(__name__)

Kernel = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


def _fa4() -> Optional[Callable]:
    from specextend.fetch import use_kernel_cache

    use_kernel_cache()  # its compiled kernels persist beside the models' (read at import)
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001  (a broken CUDA-DSL install must not stop the server)
        if not isinstance(e, ImportError):
            log.warning("flash-attn-4 is installed but failed to import (%s); using PyTorch's kernels", e)
        return None
    return flash_attn_func


def _fa2() -> Optional[Callable]:
    try:
        from flash_attn import flash_attn_func
    except Exception:  # noqa: BLE001
        return None
    return flash_attn_func


def _fa4_call(fn: Callable) -> Kernel:
    def call(q, k, v, scale, causal, window, need_lse):
        out, lse = fn(q[None], k[None], v[None], softmax_scale=scale, causal=causal,
                      window_size=(window - 1 if window > 0 else None, 0 if causal else None),
                      return_lse=need_lse)
        return out[0], (lse[0] if need_lse else None)
    return call


def _fa2_call(fn: Callable) -> Kernel:
    def call(q, k, v, scale, causal, window, need_lse):
        out, lse, _ = fn(q[None], k[None], v[None], softmax_scale=scale, causal=causal,
                         window_size=(window - 1 if window > 0 else -1, 0 if causal else -1),
                         return_attn_probs=True)
        return out[0], (lse[0].float() if need_lse else None)
    return call


def reference_kernel(q, k, v, scale, causal, window, need_lse):
    """The contract in plain math (any device and dtype): q [T, H, D], k/v [S, G, D]."""
    t, s = q.shape[0], k.shape[0]
    mask = None
    if causal or window > 0:
        pos_q = torch.arange(s - t, s, device=q.device)[:, None]  # [T, 1] end-aligned positions
        pos_k = torch.arange(s, device=q.device)[None, :]  # [1, S]
        mask = pos_k <= pos_q if causal else torch.ones(t, s, dtype=torch.bool, device=q.device)
        if window > 0:
            mask = mask & (pos_k > pos_q - window)
    out, lse = attention_eager(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale)
    return out.transpose(0, 1), (lse if need_lse else None)


class FlashKernel:
    """One of the FlashAttention releases (or the reference), with what it can take."""

    def __init__(self, name: str, call: Kernel, min_capability: tuple[int, int] = (8, 0)):
        self.name = name
        self.call = call
        self.min_capability = min_capability

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        if self.name == "reference":
            return True
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        d = q.shape[-1]
        return 8 <= d <= 256 and d % 8 == 0 and torch.cuda.get_device_capability(q.device) >= self.min_capability

    def __call__(self, q, k, v, scale: float, causal: bool, window: int, need_lse: bool):
        return self.call(q, k, v, scale, causal, window, need_lse)


_FOUND: dict[str, Optional[FlashKernel]] = {}


def find_kernel() -> Optional[FlashKernel]:
    """flash-attn-4 on Hopper or newer, else flash-attn 2, else None (looked up once)."""
    if "kernel" not in _FOUND:
        kernel = None
        if torch.cuda.is_available():
            fn = _fa4() if torch.cuda.get_device_capability() >= (9, 0) else None
            if fn is not None:
                kernel = FlashKernel("flash-attn-4", _fa4_call(fn), (9, 0))
            elif (fn := _fa2()) is not None:
                kernel = FlashKernel("flash-attn-2", _fa2_call(fn))
        _FOUND["kernel"] = kernel
    return _FOUND["kernel"]
