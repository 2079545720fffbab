"""A small function of device tensors replayed as one CUDA graph per signature.

Eager CUDA ops cost the host 10-30 us each (dispatch, allocation, launch), and the draft's
bookkeeping between forwards is a dozen of them: top-k over the vocabulary with its log-sum-exp
(~0.25 ms of host time a call on an H100, 2026-11-26, benchmarks/overlap_host.py), a tree level's
frontier, a chained level's picks. Replayed as a graph, such a function costs its input copies, one
launch and its output copies. `Graphed(fn, device)` captures `fn` at the first call of each
signature (the tensors' shapes and dtypes, and the other arguments as they are) and replays it after;
called directly, `fn` is its slow twin (the tests compare them).

Plans are shared by the sessions of one model (the draft worker's thread and tests may interleave
them): inputs are copied into the plan's static tensors, and `out` (a clone by default; `to_host`
for a host copy) is applied to each output under the lock, so that the next replay cannot overwrite
them first: any later replay is queued after these copies on the same stream.
"""

from __future__ import annotations

import statistics
import threading
from typing import Callable

import torch

from specextend.models.capture import capture
from specextend.models import late_work


def _key(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


class Graphed:
    def __init__(self, fn: Callable, device: torch.device):
        self.fn = fn
        self.plans: dict = {}
        self.lock = threading.Lock()
        self.replays = 0
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)

    def __call__(self, *args, out: Callable[[torch.Tensor], torch.Tensor] = torch.clone) -> tuple:
        key = _key(args)
        with self.lock:
            plan = self.plans.get(key)
            if plan is None:  # normal tensors (see graphs.StepGraphs.forward)
                late_work.record("capture", f"{getattr(self.fn, '__qualname__', self.fn)} {key}")
                with torch.inference_mode(False), torch.no_grad():
                    plan = self.plans[key] = self._build(args)
            graph, inputs, outputs = plan
            for dst, src in zip(inputs, args):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
            graph.replay()
            self.replays += 1
            return tuple(out(o) for o in outputs)

    def _build(self, args: tuple):
        inputs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        s = self._stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up off the capture (e.g. top-k's workspaces)
            self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, s, self._pool):
            outputs = self.fn(*inputs)
        return graph, inputs, outputs if isinstance(outputs, tuple) else (outputs,)


def replay_seconds(body: Callable[[], None], warm: Callable[[], None], reps: int) -> float:
    """Median seconds of one replay of `body` captured as a CUDA graph, timed between CUDA events
    (no host launch cost inside, launch gaps between its kernels as in the step graphs); `warm`
    runs first on the capture's side stream (Triton compiles, cuBLAS handles). Shared by the
    start-up tile choice (skinny.time_op) and the kernel benchmarks (bench.kernels.graph_us)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        warm()
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capture(graph, s):
        body()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(ts)
