"""Host <-> device copies that never wait for the device's queued work.

`torch.tensor(list, device=cuda)` and `cpu_tensor.to(cuda)` copy from pageable memory, which the
driver may stage at once or only after the kernels queued before the copy (e.g. a draft forward in
flight) have run, holding the host meanwhile (on an H200 with torch 2.11 a 3-element copy did not
wait on an idle stream; behind the batcher's queued forwards a prefill chunk's one-element copy
did, ~1 ms and more each, 2026-12-02: docs/architecture.md, "Batched steps"). From pinned memory
with `non_blocking=True`
the copy is queued in stream order and the host returns at once. PyTorch's caching host allocator
makes the pinned buffer cheap after the first few calls and keeps it from being reused until the
copy's stream has passed it, so the buffer needs no care from the caller.

On a device other than CUDA (the CPU) these are plain copies.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch

HostData = Union[Sequence, np.ndarray, torch.Tensor]


def _staged(data: HostData, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A new host tensor of `dtype` holding `data`, in pinned memory if `pin`."""
    if isinstance(data, (np.ndarray, torch.Tensor)):
        src = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
        host = torch.empty(src.shape, dtype=dtype, pin_memory=pin)
        host.copy_(src)
        return host
    return torch.tensor(data, dtype=dtype, pin_memory=pin)


def to_device(data: HostData, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` (a list, a numpy array or a CPU tensor) as a new tensor of `dtype` on `device`,
    queued without synchronising on CUDA (through pinned memory). Always a copy: the caller may
    reuse `data` at once."""
    device = torch.device(device)
    pin = device.type == "cuda"
    host = _staged(data, dtype, pin)
    if not pin:
        return host.to(device)  # a fresh tensor already (no-op move on the CPU)
    return host.to(device, non_blocking=True)


def copy_from_host(dst: torch.Tensor, data: HostData) -> None:
    """dst.copy_(data) for host `data` (a list, a numpy array or a CPU tensor), queued without
    synchronising on CUDA (through pinned memory)."""
    pin = dst.device.type == "cuda"
    dst.copy_(_staged(data, dst.dtype, pin), non_blocking=pin)


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of device tensor `x`, started without synchronising (into pinned memory, non
    blocking): it holds valid data only once the device has passed this point of its stream (an
    event recorded after it, `record_event`). On the CPU: a plain copy, valid at once."""
    if x.device.type != "cuda":
        return x.clone()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


def record_event(device: torch.device) -> Optional[torch.cuda.Event]:
    """A CUDA event recorded on the current stream of `device` (None on the CPU: work is done)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
