"""How long a target forward took, for the adaptive policy's cost line (docs/architecture.md,
"Adaptive speculation").

On a CPU a forward's host time is its duration. On a GPU the host returns as soon as the forward is
queued (a CUDA-graph replay: about 0.3 ms of host time for the 8B's 7 ms verify), so the host time
says nothing of the forward's cost and the device's time would land in whatever the step did next.
A `Span` then holds two CUDA events around the forward and is read once they have completed: by
the time the policy reads it (after the step's sampling or verification, which read the logits,
a later point of the same stream) reading it waits for nothing.
"""

from __future__ import annotations

import time
from typing import Optional

import torch


class Span:
    """A forward's duration: `host_s`, or the device time between two CUDA events when given."""

    __slots__ = ("host_s", "events")

    def __init__(self, host_s: float, events: Optional[tuple] = None) -> None:
        self.host_s = host_s
        self.events = events  # (start, end) torch.cuda.Event with timing, recorded around the forward

    def seconds(self) -> float:
        if self.events is None:
            return self.host_s
        start, end = self.events
        end.synchronize()  # complete already where the policy reads it (see above)
        return start.elapsed_time(end) / 1e3


class Stopwatch:
    """Started on a forward's inputs (`device_of` them), `stop()` gives its Span: the host's time,
    and on CUDA the events around it."""

    __slots__ = ("device", "start", "t")

    def __init__(self, inputs) -> None:
        self.device = device_of(inputs)
        self.start, self.t = mark(self.device), time.perf_counter()

    def stop(self) -> Span:
        host = time.perf_counter() - self.t
        return Span(host, None if self.start is None else (self.start, mark(self.device)))


def mark(device: Optional[torch.device]) -> Optional[torch.cuda.Event]:
    """A timing event recorded now on `device`'s current stream (None off CUDA, or with no device)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_of(x) -> float:
    """A Span's seconds, or a plain number's."""
    return x.seconds() if isinstance(x, Span) else float(x)


def device_of(x) -> Optional[torch.device]:
    """A tensor's device; None for anything else (a test's fake forward inputs)."""
    return x.device if isinstance(x, torch.Tensor) else None
