"""CUDA graph capture, one at a time in a process (docs/architecture.md, "Overlapped drafting",
captures one at a time).

Two threads capturing at once fail, even in `thread_local` error mode, each on its own stream and
memory pool: on an H100 (torch 2.13, 2026-11-28, two threads capturing 60 small graphs each) the
first 3-7 captures of each succeeded, then every one failed with "operation not permitted when
stream is capturing" or "operation failed due to a previous error during capture" (PyTorch's
caching allocator records to one graph pool at a time per device). With the draft's worker in the
target's process, its tree graphs and the target's step graphs may be captured at once; a lock
held around every capture made both threads' 60 captures succeed. Work on other threads beside a
capture (kernels, copies through pinned memory, syncs, cudaMalloc) did not disturb it."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

_LOCK = threading.RLock()


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool: Optional[tuple] = None) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool, stream)` in thread_local error mode, under the process's capture
    lock (another thread's capture waits; its replays and launches do not)."""
    with _LOCK, torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        yield
