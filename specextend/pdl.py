"""Programmatic Dependent Launch (PDL, sm_90+) for the Triton kernels of a decode-time forward
(docs/architecture.md, "Kernels").

A kernel launched with PDL may start while the kernel before it on the stream is still running:
its programs run up to `gdc_wait()` (which returns once every earlier kernel has finished and its
writes are visible), and each calls `gdc_launch_dependents()` first so the next kernel can start in
turn. What a kernel does before its wait must read nothing an earlier kernel writes: our kernels
load only weights there (skinny.py), or nothing at all (then PDL hides the launch gap alone).
Captured into CUDA graphs as programmatic edges. Off in Triton's interpreter and before sm_90.
"""

from __future__ import annotations

from typing import Optional

import torch

SWITCH: Optional[bool] = None  # None: wherever supported; False: never (benchmarks compare)


def enabled(device: torch.device) -> bool:
    from specextend.attention._triton_kernels import INTERPRETED

    if SWITCH is False or device.type != "cuda" or INTERPRETED:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_args(on: bool) -> dict:
    """Keyword arguments of a Triton launch with PDL `on`."""
    return {"launch_pdl": True} if on else {}
