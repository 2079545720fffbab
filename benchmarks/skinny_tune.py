"""Tile sweep of the skinny linear kernel (models/skinny.py) against the ops it replaces (cuBLAS
GEMMs + the RMSNorm / SiLU / bias kernels), at the draft's and small targets' decode shapes.

    python benchmarks/skinny_tune.py [--quick]

Each timing is the median of CUDA-graph replays (triton.testing.do_bench_cudagraph), so launch gaps
count as they do in the step graphs. Prints a table per shape (best configurations first) and the
JSON of every timing on the last line.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from specextend.models import skinny
from specextend.models._triton_skinny import skinny_linear

# name: (T, N, K, kind) kind: qkv (norm + bias), glu (norm, gate|up), res (residual)
SHAPES = {
    "0.5b-draft-qkv": (4, 1152, 896, "qkv"), "0.5b-draft-glu": (4, 4864, 896, "glu"),
    "0.5b-draft-o": (4, 896, 896, "res"), "0.5b-draft-down": (4, 896, 4864, "res"),
    "1.5b-ar-qkv": (1, 2048, 1536, "qkv"), "1.5b-ar-glu": (1, 8960, 1536, "glu"),
    "1.5b-ar-o": (1, 1536, 1536, "res"), "1.5b-ar-down": (1, 1536, 8960, "res"),
    "1.5b-verify-glu": (17, 8960, 1536, "glu"), "1.5b-verify-down": (17, 1536, 8960, "res"),
}


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    results = []
    for name, (t, n, k, kind) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(t, k, device=dev, generator=g).to(dt)
        nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt)
        rows = 2 * n if kind == "glu" else n
        ws = [torch.randn(rows, k, device=dev, generator=g).to(dt) * 0.02 for _ in range(8)]  # rotate: > L2
        b = torch.randn(n, device=dev, generator=g).to(dt)
        y = torch.zeros(t, n, device=dev, dtype=dt)
        it = itertools.cycle(range(len(ws)))

        def ref():
            w = ws[next(it)]
            if kind == "qkv":
                return F.linear(F.rms_norm(x, (k,), nw, 1e-6), w, b)
            if kind == "glu":
                gate, up = F.linear(F.rms_norm(x, (k,), nw, 1e-6), w).chunk(2, dim=-1)
                return F.silu(gate) * up
            return y.addmm_(x, w.t())

        base = bench(ref)
        floor = rows * k * 2 / 3.0e12 * 1e6  # us at ~3.0 TB/s (H100 copy bandwidth)
        row = dict(shape=name, t=t, n=n, k=k, torch_us=base, floor_us=floor, configs=[])
        bns = (16, 32, 64)
        bks = (128, 256, 512)
        for bn, bk, warps, stages in itertools.product(bns, bks, (4,) if a.quick else (2, 4, 8), (2, 3, 4)):
            def run():
                w = ws[next(it)]
                skinny_linear[(-(-n // bn),)](x, nw, w, b, y, 1e-6, t, K=k, N=n, NORM=kind != "res",
                                              BIAS=kind == "qkv", GLU=kind == "glu", RESIDUAL=kind == "res",
                                              IEEE=False, BT=max(16, triton.next_power_of_2(t)), BN=bn, BK=bk,
                                              num_warps=warps, num_stages=stages)
            try:
                us = bench(run)
            except Exception as e:  # noqa: BLE001 - out of resources: reported
                us = float("nan")
                print(name, bn, bk, warps, stages, type(e).__name__)
            row["configs"].append(dict(bn=bn, bk=bk, warps=warps, stages=stages, us=us))
        best = sorted((c for c in row["configs"] if c["us"] == c["us"]), key=lambda c: c["us"])
        cur = skinny.config(t, n, k)
        print(f"\n{name} T={t} N={n} K={k}: torch {base:.2f} us, floor {floor:.2f} us, current config "
              f"{[c['us'] for c in row['configs'] if c['bn'] == cur['BN'] and c['bk'] == cur['BK'] and c['warps'] == 4 and c['stages'] == 3]}")
        for c in best[:5]:
            print(f"  bn={c['bn']} bk={c['bk']} warps={c['warps']} stages={c['stages']}: {c['us']:.2f} us")
        results.append(row)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
