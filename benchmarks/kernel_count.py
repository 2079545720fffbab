"""Kernels per layer of a decode-time graph segment, plain torch ops vs the fused Triton kernels.

    python benchmarks/kernel_count.py [--arch qwen2] [--dtype float32]

Counts, with a TorchDispatchMode on the CPU, the aten ops of one `mid` segment (layer i-1's
attention tail and MLP, layer i's pre-attention: one layer's work between two prefix-kernel
calls) of a 7-query tree verification, plus the Triton launches. Views and allocations are not
kernels; on CUDA, RMSNorm is one kernel, which the CPU decomposes into six ops (eight in half
precision; counted as one here). The split-KV prefix kernel (one more per layer in both) is not
in the segment. Table, then JSON on the last line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused kernels run in Triton's interpreter here

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import build_pair  # noqa: E402

from specextend.attention.backends import CAUSAL  # noqa: E402
from specextend.models import fused_layer  # noqa: E402
from specextend.models.decoder import ForwardOptions  # noqa: E402
from specextend.models.full_graphs import FullStepGraphs  # noqa: E402
from specextend.tree import ancestor_mask  # noqa: E402

NOT_KERNELS = {"view", "_unsafe_view", "transpose", "t", "select", "slice", "unsqueeze", "expand", "alias",
               "as_strided", "reshape", "split", "chunk", "detach", "permute", "squeeze", "split_with_sizes",
               "unbind", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "set_"}
RMS_NORM_CPU_OPS = {"pow": 1, "mean": 1, "add_": 1, "rsqrt": 1, "mul": 2}  # one F.rms_norm on the CPU


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def count(arch: str, dtype: torch.dtype, fused: bool) -> dict:
    _, dec = build_pair(arch, "torch")
    dec.w = dec.w.to(dtype=dtype)
    graphs = FullStepGraphs(dec, capture=False, fused=fused)
    cache = dec.new_cache(64)
    dec.forward_eager(torch.arange(20), torch.arange(20), cache, CAUSAL, ForwardOptions())
    cache.advance(20)
    parents = [-1, 0, 0, 1, 1, 3]  # 6 drafted nodes under the root: 7 queries
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 4])
    graphs.forward(torch.arange(7), 20 + depths, cache, ancestor_mask(parents, "cpu"), ForwardOptions())
    plan = next(iter(graphs.plans.values()))
    launches = collections.Counter()
    saved = {n: getattr(fused_layer, n) for n in ("tree_combine", "rope_scatter", "silu_mul", "rms_norm")}

    def counted(name):
        def call(*a, **k):
            launches[name] += 1
            return saved[name](*a, **k)
        return call

    for n in saved:
        setattr(fused_layer, n, counted(n))
    try:
        with Count() as c:
            graphs._segment(plan, 1)
    finally:
        for n, f in saved.items():
            setattr(fused_layer, n, f)
    ops = collections.Counter({k: v for k, v in c.ops.items() if k not in NOT_KERNELS})
    if fused:  # the interpreter's own tensor copies are not kernels
        ops.pop("copy_", None)
    per_norm = dict(RMS_NORM_CPU_OPS, **({} if dtype == torch.float32 else {"_to_copy": 2}))  # up/down casts
    norms = min(ops[k] // n for k, n in per_norm.items())
    for k, n in per_norm.items():
        ops[k] -= n * norms
    ops = +ops
    if norms:
        ops["rms_norm"] = norms
    total = sum(ops.values()) + sum(launches.values())
    return dict(arch=arch, dtype=str(dtype), fused=fused, kernels=total, aten=dict(ops), triton=dict(launches))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen2", help="a tests/helpers.py CONFIGS name")
    ap.add_argument("--dtype", default="float32,float16")
    a = ap.parse_args()
    rows = [count(a.arch, getattr(torch, dt), fused) for dt in a.dtype.split(",") for fused in (False, True)]
    print("| arch | dtype | segment | kernels per layer | ops |\n|---|---|---|---|---|")
    for r in rows:
        ops = ", ".join(f"{k} {v}" for k, v in sorted({**r["aten"], **r["triton"]}.items()))
        print(f"| {r['arch']} | {r['dtype']} | {'fused' if r['fused'] else 'plain'} | {r['kernels']} | {ops} |")
    print(json.dumps(dict(date=time.strftime("%Y-%m-%d"), rows=rows)))


if __name__ == "__main__":
    main()
