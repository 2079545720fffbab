"""The Triton split-KV prefix kernel (attention/triton_prefix.py) against PyTorch's flash kernel.

  python benchmarks/prefix_kernel.py --length 16384

One layer of an 8B-geometry cache (G=8 KV heads, D=128, bf16): queries of T new tokens folded
(H/G=4 rows each) over L prefix keys. Times (CUDA events, median) each kernel configuration and
flash (sdpa_lse, the piecewise graphs' call), with the bytes floor (K and V read once); with
--with-combine, each configuration followed by the fused combine kernel that reads its S partials
(ranked by the sum). Table, then JSON on the last line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from specextend.attention.backends import sdpa_lse
from specextend.attention.triton_prefix import cache_meta, num_splits, prefix_partials
from specextend.bench.kernels import graph_us


def bench(fn, reps=10, per_graph=20):
    """Median device time of one call (us), from CUDA-graph replays of `per_graph` calls."""
    return graph_us(fn, reps, per_graph, warmup=3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--tokens", default="1,51")
    p.add_argument("--with-combine", action="store_true",
                   help="also time each configuration followed by the fused combine kernel (fused_layer.tree_combine), "
                        "which reads the S partials: fewer splits write and read less")
    p.add_argument("--split-factors", default="1,2", help="multiples of num_splits to try (e.g. 0.25,0.5,1,2)")
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    G, D, R, L = 8, 128, 4, a.length
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    data = torch.randn(2, 2, G, L + 256, D, device=dev, dtype=dt)  # two layers: time layer 1
    anchor = torch.zeros(16, dtype=dt, device=dev)
    meta = torch.tensor(cache_meta(data, anchor, L), dtype=torch.int64, device=dev)
    # copy bandwidth (read + write) for the floor
    x = torch.empty(2**28, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    bw = 2 * x.numel() / (bench(lambda: y.copy_(x), 5, 5) * 1e-6)
    kv_bytes = 2 * G * L * D * 2
    rows_out = []
    for t in [int(v) for v in a.tokens.split(",")]:
        m = R * t
        q = torch.randn(G, m, D, device=dev, dtype=dt)
        k4, v4 = data[1, 0, :, :L][None], data[1, 1, :, :L][None]
        flash = bench(lambda: sdpa_lse(q.view(1, G, m, D), k4, v4, False, 0.088))
        _, ref_lse = sdpa_lse(q.view(1, G, m, D), k4, v4, False, 0.088)
        row = dict(tokens=t, rows=m, flash_us=flash, floor_us=kv_bytes / bw * 1e6)
        best = None
        base_s = num_splits(m, G, sms)
        bms = (0, 64) if m > 64 else (0,)  # 0: config()'s (128 past 64 rows)
        factors = [float(f) for f in a.split_factors.split(",")]
        if a.with_combine:
            from specextend.models.fused_layer import tree_combine

            kt, vt = (torch.randn(G, t, D, device=dev, dtype=dt) for _ in range(2))  # a chain of t tree keys
            bias = torch.zeros(t, t, device=dev).masked_fill_(
                ~torch.ones(t, t, dtype=torch.bool, device=dev).tril(), float("-inf")).repeat(R, 1)
            qh = q.view(G * R, t, D)  # [H, T, D]: the folded rows are (head in group, token)
        for bm, bn, warps, stages, sf in itertools.product(bms, (64, 128), (4, 8), (2, 3, 4), factors):
            s = max(1, round(base_s * sf))
            out = torch.empty(G, s, m, D, device=dev)
            lse = torch.empty(G, s, m, device=dev)
            try:
                us = bench(lambda: prefix_partials(q, anchor, meta, 1, 0.088, out, lse, bn, warps, stages, bm))
            except Exception as e:  # noqa: BLE001  (a configuration the compiler rejects)
                print(f"t={t} bn={bn} warps={warps} stages={stages}: {type(e).__name__}")
                continue
            if a.with_combine:
                row[f"bm{bm or 'auto'}_bn{bn}_w{warps}_s{stages}_x{s}_combined"] = bench(lambda: (
                    prefix_partials(q, anchor, meta, 1, 0.088, out, lse, bn, warps, stages, bm),
                    tree_combine(qh, kt, vt, bias, out, lse, 0.088)))
            merged_lse = torch.logsumexp(lse, dim=1)
            err = (merged_lse - ref_lse[0].float()).abs().max().item()
            key = f"bm{bm or 'auto'}_bn{bn}_w{warps}_s{stages}_x{s}"
            row[key] = us
            if err > 1e-2:
                print(f"t={t} {key}: lse error {err}")
            else:
                us = row.get(key + "_combined", us)  # ranked by prefix + combine where timed
                if best is None or us < best[1]:
                    best = (key, us)
        row["best"] = best
        rows_out.append(row)
        print(f"T={t}: flash {flash:.1f} us, best triton {best[0]} {best[1]:.1f} us, floor {row['floor_us']:.1f} us",
              flush=True)
    print("\n| T | rows | flash us | best Triton config | Triton us | floor us |\n|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['tokens']} | {r['rows']} | {r['flash_us']:.1f} | {r['best'][0]} | {r['best'][1]:.1f} | "
              f"{r['floor_us']:.1f} |")
    print(json.dumps(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), length=L,
                          copy_bandwidth_Bps=bw, rows=rows_out)))


if __name__ == "__main__":
    main()
