"""Linear layers of a few rows in one kernel each, with their neighbours fused in (docs/architecture.md,
"Kernels"): a decode-time forward of a small model (the draft's tree levels, 4-16 rows; an AR step,
1 row) is bound by its count of small kernels, not by its weights (H100, 2026-11-23: the 0.5B
draft's level took ~11 graph nodes a layer, each a device launch gap and ~1.4-2.7 us of host
launch cost, for ~30 MB of weights, 10 us at the copy bandwidth).

    norm_linear        RMSNorm + x @ W.T (+ bias)           the QKV projection: 3 kernels -> 1
    norm_glu           RMSNorm + silu(x @ G.T) * (x @ U.T)   the MLP's first half: 3 -> 1
    linear_residual_   x += a @ W.T, in place                o-proj and down-proj: 1-2 -> 1

The norm's statistics come from the x tiles the dot reads anyway, and its scale is applied to the
accumulator (rstd * ((x * w_norm) @ W.T)), so no normalized copy of x is written. Rows are padded
to 16 for the tensor cores; the weights are read once, by cdiv(N, BN) * SPLIT programs (split-K for
the narrow outputs of linear_residual_: _triton_skinny.py).

Which tile, and whether this kernel at all, is measured per shape on the GPU the first time a
shape is met outside a graph capture (`choose`: the plan's warm-up forward, before its capture),
against the ordinary ops it replaces, with the weights rotated past the L2 cache as a forward's
layers are. The choice is kept for the process. On the CPU (Triton's interpreter: tests) the
default tile runs.

Slow twin: `reference` (the torch ops the plain forward runs); tests compare them, on the CPU
through Triton's interpreter.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

MAX_ROWS = 64  # more rows: the ordinary GEMMs (tiles of 16 rows stop paying)
KINDS = ("qkv", "glu", "res")  # norm + linear + bias, norm + gate/up GLU, linear + residual


@dataclass(frozen=True)
class Tile:
    bn: int  # output columns per program
    bk: int  # K columns per loop iteration
    split: int = 1  # programs sharing a column block (split-K; `res` only)
    warps: int = 4
    stages: int = 3


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (n - 1).bit_length())


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_ROWS and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16,
                                                                          torch.float32)


def _split_for(tiles: int, k: int, bk: int, num_sms: int) -> int:
    """The fewest K splits (a power of two) that give every multiprocessor a program, keeping at
    least two BK iterations per split."""
    split = 1
    while tiles * split < num_sms and k // (bk * split * 2) >= 2:
        split *= 2
    return split


def default_tile(kind: str, t: int, n: int, k: int, num_sms: int = 132, ieee: bool = False) -> Tile:
    """Output blocks of 64, 32 or 16 columns, the widest that still gives every multiprocessor a
    program; for `res` (no norm statistics to gather), split-K where even 16 columns leave
    multiprocessors idle. float32 (IEEE dots on CUDA cores) takes half the tiles: the gate/up pair
    spilled at 32+ rows, and at one row with 32 columns once split-K was in the kernel (sm_90,
    benchmarks/triton_aot.py)."""
    bn = next((b for b in (64, 32) if -(-n // b) >= num_sms), 16)
    if ieee:
        bn, bk, stages = (16 if t > 32 or kind == "glu" else min(bn, 32)), min(64, _pow2(k)), 2
    else:
        bk, stages = min(128, _pow2(k)), 3
    split = _split_for(-(-n // bn), k, bk, num_sms) if kind == "res" else 1
    return Tile(bn, bk, split, 4, stages)


def config(t: int, n: int, k: int, num_sms: int = 132, ieee: bool = False, kind: str = "qkv") -> dict:
    """default_tile as the kernel's launch arguments (benchmarks/triton_aot.py)."""
    c = default_tile(kind, t, n, k, num_sms, ieee)
    return dict(BT=_pow2(t), BN=c.bn, BK=c.bk, SPLIT=c.split, KS=_ks(k, c), num_warps=c.warps, num_stages=c.stages)


def _ks(k: int, c: Tile) -> int:
    return -(-(-(-k // c.split)) // c.bk) * c.bk  # K columns per split, a multiple of BK


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(w: torch.Tensor, bt: int, tiles: int) -> torch.Tensor:
    """Split-K arrival counters of one weight matrix at one row tile: zeroed once; the kernel
    leaves them zero. A forward's calls on one weight at one shape never overlap (a plan's static
    buffers forbid it anyway), so they may share them across launches and graph replays."""
    key = (w.device, w.data_ptr(), bt, tiles)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(tiles, dtype=torch.int32, device=w.device)
    return c


def _launch(x, nw, w, b, y, eps, n, glu, residual, tile: Optional[Tile] = None):
    from specextend.models._triton_skinny import skinny_linear as kernel

    t, k = x.shape
    assert x.is_contiguous() and w.is_contiguous() and y.is_contiguous() and t <= MAX_ROWS
    ieee = x.dtype == torch.float32
    kind = "glu" if glu else ("res" if nw is None and b is None else "qkv")
    c = tile or default_tile(kind, t, n, k, ieee=ieee)
    assert c.split == 1 or not (glu or nw is not None), "split-K only without the norm and the GLU"
    bt, tiles = _pow2(t), -(-n // c.bn)
    dummy = w  # an unused pointer argument
    ws = cnt = dummy
    if c.split > 1:
        ws = torch.empty(c.split, bt, n, dtype=torch.float32, device=x.device)  # [SPLIT, BT, N] partials
        cnt = _counters(w, bt, tiles)
    kernel[(tiles, c.split)](x, nw if nw is not None else dummy, w, b if b is not None else dummy, y, ws, cnt,
                             float(eps), t, K=k, N=n, NORM=nw is not None, BIAS=b is not None, GLU=glu,
                             RESIDUAL=residual, IEEE=ieee, BT=bt, BN=c.bn, BK=c.bk, SPLIT=c.split, KS=_ks(k, c),
                             num_warps=c.warps, num_stages=c.stages)
    return y


def norm_linear(x: torch.Tensor,  # [T, K]
                nw: Optional[torch.Tensor], eps: float,  # [K] RMSNorm weight (None: no norm)
                w: torch.Tensor,  # [N, K]
                b: Optional[torch.Tensor] = None, tile: Optional[Tile] = None) -> torch.Tensor:  # [N]
    """-> rms_norm(x) @ w.T + b [T, N]."""
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, nw, w, b, y, eps, w.shape[0], False, False, tile)


def norm_glu(x: torch.Tensor, nw: torch.Tensor, eps: float,
             w: torch.Tensor, tile: Optional[Tile] = None) -> torch.Tensor:  # [2I, K]: gate rows, then up rows
    """-> silu(rms_norm(x) @ gate.T) * (rms_norm(x) @ up.T) [T, I]."""
    i = w.shape[0] // 2
    y = torch.empty(x.shape[0], i, dtype=x.dtype, device=x.device)
    return _launch(x, nw, w, None, y, eps, i, True, False, tile)


def linear_residual_(x: torch.Tensor,  # [T, N], updated in place
                     a: torch.Tensor,  # [T, K]
                     w: torch.Tensor, tile: Optional[Tile] = None) -> torch.Tensor:  # [N, K]
    """x += a @ w.T; returns x."""
    return _launch(a, None, w, None, x, 0.0, w.shape[0], False, True, tile)


def reference(x, nw, eps, w, b=None, glu: bool = False, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The slow twin of all three: the torch ops of decoder.layer_pre / layer_post."""
    h = F.rms_norm(x, (x.shape[-1],), nw, eps) if nw is not None else x
    if glu:
        gate, up = F.linear(h, w).chunk(2, dim=-1)
        return F.silu(gate) * up
    y = F.linear(h, w, b)
    return y if residual is None else residual + y


# ---------------------------------------------------------------- the per-shape choice
_CHOICES: dict[tuple, Optional[Tile]] = {}
Op = Callable[[torch.Tensor], None]  # runs the layer's op on one weight matrix (timing inputs bound)


def candidates(kind: str, t: int, n: int, k: int, num_sms: int, ieee: bool) -> list[Tile]:
    """The default tile and its neighbours: half and double the column block, a wider K step,
    and (for `res`) half and double the split."""
    d = default_tile(kind, t, n, k, num_sms, ieee)
    if ieee:
        return [d]
    out = [d, Tile(min(64, d.bn * 2), d.bk, d.split), Tile(max(16, d.bn // 2), d.bk, d.split),
           Tile(d.bn, min(256, _pow2(k)), d.split)]
    if kind == "res":
        out += [Tile(d.bn, d.bk, max(1, d.split // 2)), Tile(d.bn, d.bk, d.split * 2)]
    return list(dict.fromkeys(c for c in out if c.split * c.bk <= _pow2(k)))


def choose(kind: str, x: torch.Tensor, w: torch.Tensor, twin: Op, kernel: Callable[[torch.Tensor, Tile], None],
           n: int) -> Optional[Tile]:
    """The tile to run `kind` at x's rows against w [.., K] with (None: the ordinary ops, `twin`,
    measured faster). `kernel(w, tile)` and `twin(w)` run the op on scratch inputs; they are timed
    only on CUDA, outside a capture, once per (device, kind, rows, N, K, dtype)."""
    t, k = x.shape[0], w.shape[1]
    ieee = x.dtype == torch.float32
    if x.device.type != "cuda":
        return default_tile(kind, t, n, k, ieee=ieee)
    key = (x.device, kind, t, n, k, x.dtype)
    if key in _CHOICES:
        return _CHOICES[key]
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if torch.cuda.is_current_stream_capturing():  # a shape the warm-up did not run: no timing now
        return default_tile(kind, t, n, k, num_sms, ieee)
    copies = _weight_copies(w)
    times = {None: time_op(twin, copies)}
    for c in candidates(kind, t, n, k, num_sms, ieee):
        try:
            times[c] = time_op(lambda ww, c=c: kernel(ww, c), copies)
        except Exception:  # noqa: BLE001 - a tile that does not compile here (resources) is not chosen
            continue
    del copies
    best = min(times, key=times.get)
    _CHOICES[key] = best
    return best


def choices() -> dict:
    """What `choose` picked so far: {(kind, T, N, K, dtype): tile or "torch"} (benchmarks, logs)."""
    return {k[1:]: (v if v is not None else "torch") for k, v in _CHOICES.items()}


def _weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """Random matrices shaped like w, together twice the L2 cache (at least 4): a forward reads
    each layer's weights from memory, not from L2."""
    l2 = getattr(torch.cuda.get_device_properties(w.device), "L2_cache_size", 64 << 20)
    count = max(4, min(64, math.ceil(2 * l2 / (w.numel() * w.element_size()))))
    g = torch.Generator(device=w.device).manual_seed(0)
    return [(torch.randn(w.shape, generator=g, device=w.device) * 0.02).to(w.dtype) for _ in range(count)]


def time_op(op: Op, copies: list[torch.Tensor], reps: int = 5) -> float:
    """Median seconds of one call of op, from CUDA-graph replays of one call per weight copy
    (launch gaps count as in the step graphs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile, cuBLAS handles
        op(copies[0])
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        for w in copies:
            op(w)
    graph.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3 / len(copies))
    return statistics.median(ts)
