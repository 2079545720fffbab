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
the narrow outputs of linear_residual_: _triton_skinny.py), or by a persistent grid of fewer
programs, each streaming several column blocks (`Tile.programs`: skinny_tiles).

Which tile, and whether this kernel at all, is measured per shape on the GPU the first time a
shape is met outside a graph capture (`choose`: the plan's warm-up forward, before its capture),
against the ordinary ops it replaces, with the weights rotated past the L2 cache as a forward's
layers are. The choice is kept for the process. On the CPU (Triton's interpreter: tests) the
default tile runs.

Slow twin: `reference` (the torch ops the plain forward runs); tests compare them, on the CPU
through Triton's interpreter.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from specextend.models.graphed import replay_seconds
from specextend.pdl import launch_args

MAX_ROWS = 64  # more rows: the ordinary GEMMs (tiles of 16 rows stop paying)
KINDS = ("qkv", "glu", "res")  # norm + linear + bias, norm + gate/up GLU, linear + residual


@dataclass(frozen=True)
class Tile:
    bn: int  # output columns per program
    split: int = 1  # programs sharing a column block, each over K / split columns (split-K)
    warps: int = 4
    bk: int = 0  # > 0: the streamed kernel (skinny_loop), K columns per loop step; 0: whole slice
    stages: int = 3  # the streamed kernel's loads in flight (software pipelining)
    programs: int = 0  # > 0: the persistent kernel (skinny_tiles) on at most this many programs, bk a unit


# Weight and x elements one program holds in registers (its [BN, KS] weight slice, twice for the
# GLU, and its [BT, KS] x tile), per warp count: 64 float32-equivalent registers a thread at most.
BUDGET = {4: 4096, 8: 8192}


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (n - 1).bit_length())


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_ROWS and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16,
                                                                          torch.float32)


def k_slice(kind: str, t: int, k: int, c: Tile) -> tuple[int, int, int]:
    """(KS, KSP, split): K columns per program (a multiple of 32, or of the loop step bk), that
    rounded up to a power of two (the register tile of the whole-slice kernel), and the programs
    per column block that cover K."""
    if c.programs:
        return k, k, 1
    if c.bk:
        ks = -(-(-(-k // c.split)) // c.bk) * c.bk
        return ks, ks, -(-k // ks)
    ks = -(-(-(-k // c.split)) // 32) * 32
    return ks, _pow2(ks), -(-k // ks)


def default_tile(kind: str, t: int, n: int, k: int, warps: int = 8) -> Tile:
    """Column blocks of 16 (the smallest tensor-core tile: the most programs in flight); K split so
    that a program's weight slice and x tile fit in its registers (BUDGET)."""
    bn = 16
    per_col = bn * (2 if kind == "glu" else 1) + _pow2(t)  # elements per K column
    ksp = 1 << (BUDGET[warps] // per_col).bit_length() - 1  # the widest power of two that fits
    return Tile(bn, max(1, -(-k // ksp)), warps)


def config(t: int, n: int, k: int, kind: str = "qkv", ieee: bool = False) -> dict:
    """default_tile as the kernel's launch arguments (benchmarks/triton_aot.py)."""
    c = default_tile(kind, t, n, k, 4 if ieee else 8)
    ks, ksp, split = k_slice(kind, t, k, c)
    return dict(BT=_pow2(t), BN=c.bn, KS=ks, KSP=ksp, SPLIT=split, BKX=min(256, _pow2(k)), num_warps=c.warps)


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


def pdl(device: torch.device) -> bool:
    """Programmatic Dependent Launch (specextend/pdl.py): compiled, not interpreted, on sm_90+."""
    from specextend import pdl as pdl_mod

    return pdl_mod.enabled(device)


def _launch(x, nw, w, b, y, eps, n, glu, residual, tile: Optional[Tile] = None):
    from specextend.models import _triton_skinny as kernels

    t, k = x.shape
    assert x.is_contiguous() and w.is_contiguous() and y.is_contiguous() and t <= MAX_ROWS
    kind = "glu" if glu else ("res" if nw is None and b is None else "qkv")
    c = tile or default_tile(kind, t, n, k)
    ks, ksp, split = k_slice(kind, t, k, c)
    bt, tiles = _pow2(t), -(-n // c.bn)
    dummy = w  # an unused pointer argument
    ws = cnt = dummy
    if split > 1:
        ws = torch.empty(split, 2, bt, n, dtype=torch.float32, device=x.device)  # [SPLIT, gate|up, BT, N] partials
        cnt = _counters(w, bt, tiles)
    on = pdl(x.device)
    args = (x, nw if nw is not None else dummy, w, b if b is not None else dummy, y, ws, cnt, float(eps), t)
    flags = dict(K=k, N=n, NORM=nw is not None, BIAS=b is not None, GLU=glu, RESIDUAL=residual,
                 IEEE=x.dtype == torch.float32, BT=bt, BN=c.bn, KS=ks, SPLIT=split, BKX=min(256, _pow2(k)), PDL=on,
                 LATE=LATE_TRIGGER, num_warps=c.warps, **launch_args(on))
    if c.programs:
        assert c.bk and split == 1, c
        flags = {f: v for f, v in flags.items() if f not in ("KS", "SPLIT")}
        progs = min(c.programs, tiles)
        from specextend.attention._triton_kernels import INTERPRETED
        kernels.skinny_tiles[(progs,)](x, args[1], w, args[3], y, float(eps), t, progs, BK=c.bk, STAGES=c.stages,
                                       INTERPRET=INTERPRETED, **flags)
    elif c.bk:
        kernels.skinny_loop[(tiles, split)](*args, BK=c.bk, STAGES=c.stages, **flags)
    else:
        kernels.skinny_linear[(tiles, split)](*args, KSP=ksp, **flags)
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
# True (benchmarks): `choose` weighs only this module's kernels, never the ordinary ops, so that
# every projection of a layer is a PDL-launched kernel of ours (a cuBLAS GEMM in the chain neither
# starts early nor lets the next kernel do so: docs/architecture.md, "Kernels")
KERNELS_ONLY = False
# True (benchmarks): the kernels let the next kernel launch once their main loop is done, not at their
# start (with PDL)
LATE_TRIGGER = False
Op = Callable[[torch.Tensor], None]  # runs the layer's op on one weight matrix (timing inputs bound)


def streamed_tile(n: int, k: int, bn: int, bk: int = 128, programs: int = 128) -> Tile:
    """The streamed kernel with column blocks of bn, K split (a power of two, at most 8, each
    program at least one loop step) until about `programs` programs run: one per multiprocessor,
    each streaming its slice with its loads pipelined."""
    split = 1
    while -(-n // bn) * split < programs and split < 8 and k // (2 * split) >= bk:
        split *= 2
    return Tile(bn, split, 4, bk, 3)


def candidates(kind: str, t: int, n: int, k: int, sms: int = 0) -> list[Tile]:
    """The streamed kernel at 16- and 32-column blocks, with the split streamed_tile picks and
    half of it; the whole-slice kernel's default tile; where the output has more column blocks
    than the device has multiprocessors (`sms`), the persistent kernel on one and two programs per
    multiprocessor."""
    out = []
    for bn in (16, 32):
        c = streamed_tile(n, k, bn)
        out += [c, Tile(bn, max(1, c.split // 2), 4, 128, 3)]
    out.append(default_tile(kind, t, n, k, 8))
    for bn, per_sm in itertools.product((16, 32), (1, 2)) if sms else ():
        if -(-n // bn) > per_sm * sms:
            out.append(Tile(bn, 1, 4, 128, 4, per_sm * sms))
    return list(dict.fromkeys(out))


def choose(kind: str, x: torch.Tensor, w: torch.Tensor, twin: Op, kernel: Callable[[torch.Tensor, Tile], None],
           n: int) -> Optional[Tile]:
    """The tile to run `kind` at x's rows against w [.., K] with (None: the ordinary ops, `twin`,
    measured faster). `kernel(w, tile)` and `twin(w)` run the op on scratch inputs; they are timed
    only on CUDA, outside a capture, once per (device, kind, rows, N, K, dtype)."""
    t, k = x.shape[0], w.shape[1]
    if x.device.type != "cuda":
        return default_tile(kind, t, n, k)
    key = (x.device, kind, t, n, k, x.dtype, pdl(x.device))
    if key in _CHOICES:
        return _CHOICES[key]
    if torch.cuda.is_current_stream_capturing():  # a shape the warm-up did not run: no timing now,
        return None  # and the ordinary ops are the known quantity
    copies = _weight_copies(w)
    times = {} if KERNELS_ONLY else {None: time_op(twin, copies)}
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for c in candidates(kind, t, n, k, sms):
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
    def body():
        for w in copies:
            op(w)
    return replay_seconds(body, lambda: op(copies[0]), reps) / len(copies)
