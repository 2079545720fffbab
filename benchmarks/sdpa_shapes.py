"""What a masked attention of a new shape costs the first time, per PyTorch SDPA backend: the draft's
windowed prefill chunk (docs/architecture.md, "Attention backends") passes an explicit mask, and a
prompt's last chunk has a row count no earlier call had. For each backend, rows T = base + a few new
odd counts, keys 511 + T (a window of 512 after the first chunk), the 0.5B draft's heads; prints the
first call's and a repeat's milliseconds (synchronized).

    python benchmarks/sdpa_shapes.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--rows", default="101,117,2048,133,77")
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    backends = {"default": None, "efficient": [SDPBackend.EFFICIENT_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
                "math": [SDPBackend.MATH]}
    print("cudnn_sdp_enabled", torch.backends.cuda.cudnn_sdp_enabled(), "torch", torch.__version__,
          "cudnn", torch.backends.cudnn.version())
    for offset, (name, which) in enumerate(backends.items()):
        for t in [int(x) + offset for x in a.rows.split(",")]:
            s = a.window - 1 + t
            q = torch.randn(1, a.heads, t, a.head_dim, device=dev, dtype=dt)
            k = torch.randn(1, a.heads, s, a.head_dim, device=dev, dtype=dt)
            v = torch.randn_like(k)
            pos_q = torch.arange(s - t, s, device=dev)[:, None]
            pos_k = torch.arange(s, device=dev)[None, :]
            mask = (pos_k <= pos_q) & (pos_k > pos_q - a.window)

            def call():
                if which is None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                with sdpa_kernel(which):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            try:
                first, again = timed(call), timed(call)
            except RuntimeError as e:
                print(f"{name:9s} T={t:5d}: {str(e).splitlines()[0][:100]}")
                continue
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            kernels = sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            print(f"{name:9s} T={t:5d} S={s:5d}: first {first:8.1f} ms, again {again:6.2f} ms; {kernels[:3]}", flush=True)


if __name__ == "__main__":
    main()
