"""HTA over a short committed cache: the split path (prefix_partials + tree_combine, two kernels)
against short_attention (one kernel, attention/triton_short.py), at the draft's geometry.

    python benchmarks/short_attention.py                       # the table, about 30 s on an H200
    python benchmarks/short_attention.py --sweep --tokens 8,64 --staged 64   # + launch configurations

Qwen2.5-0.5B draft layer: 14 query heads, 2 KV heads, D = 64, bf16; T new tokens (rows 7 T) over L
committed keys and n = staged + T tree keys with a tree mask, no LSE (the draft's levels). Each
variant is captured in a CUDA graph of `per_graph` calls (as in the step graphs: no host launch
cost, the gaps between dependent kernels included) and replayed; CUDA events, median per call.
`cold`: each call reads another layer of a cache larger than 3x L2 (as in a forward, where a
layer's weights evict the previous layer's K/V); `hot`: the same layer each time (L2-resident).
Checks that both variants agree (out and merged LSE, layer 0) before timing; exits 1 if not.
Table, then JSON on the last line. `--device cpu` (under TRITON_INTERPRET=1, small --lengths) runs
every code path but times nothing: the tests' check of this script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time

import torch

from specextend.attention.tree_merge import mask_bias
from specextend.attention.triton_prefix import cache_meta, num_splits, prefix_partials
from specextend.attention.triton_short import config as short_config
from specextend.attention.triton_short import short_attention
from specextend.models.fused_layer import tree_combine

H, G, D = 14, 2, 64  # Qwen2.5-0.5B
R = H // G


def timed(calls, reps: int = 15, per_graph: int = 0) -> float:
    """Median device time (us) of one call: calls[i % len(calls)] for i < per_graph (default: each
    once, at least 24 calls) captured in one CUDA graph after warm-up, the graph replayed `reps`
    times between CUDA events. Off CUDA: each call run once, nan."""
    if not torch.cuda.is_available():
        for c in calls:
            c()
        return float("nan")
    per_graph = per_graph or max(24, len(calls))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:3]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(per_graph):
            calls[i % len(calls)]()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / per_graph)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096", help="committed keys L")
    p.add_argument("--tokens", default="8,16,64", help="new tokens T (rows 7 T)")
    p.add_argument("--staged", default="16,64", help="staged tree keys (n = staged + T)")
    p.add_argument("--sweep", action="store_true",
                   help="also time short_attention's launch configurations (bm x block_n x warps x stages)")
    p.add_argument("--sweep-bm", default="16,32", help="row blocks the sweep tries")
    p.add_argument("--sweep-bn", default="64,128", help="committed-key blocks the sweep tries")
    p.add_argument("--sweep-warps", default="2,4,8")
    p.add_argument("--sweep-stages", default="2,3,4")
    p.add_argument("--device", default="cuda", help="cuda; cpu only checks the code paths (Triton's interpreter)")
    a = p.parse_args()
    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16  # the interpreter misreads bfloat16
    torch.manual_seed(0)
    lengths = [int(x) for x in a.lengths.split(",")]
    cap = max(lengths) + 128
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        sms, l2 = props.multi_processor_count, getattr(props, "L2_cache_size", 50 << 20)
    else:
        sms, l2 = 132, 0

    def layers_for(L: int) -> int:
        """Cache layers a cold run cycles through: their K/V read (bf16) past 3x L2."""
        return max(2, min(512, math.ceil(3 * l2 / (4 * G * L * D))))

    copies = layers_for(min(lengths))
    data = torch.randn(copies, 2, G, cap, D, device=dev, dtype=dt)  # KVCache.data layout, `copies` layers
    anchor = torch.zeros(16, dtype=dt, device=dev)
    scale = D ** -0.5
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    sweep = list(itertools.product(ints(a.sweep_bm), ints(a.sweep_bn), ints(a.sweep_warps),
                                   ints(a.sweep_stages))) if a.sweep else []
    rows_out, bad = [], []
    t0 = time.perf_counter()
    for t, staged in itertools.product([int(x) for x in a.tokens.split(",")], [int(x) for x in a.staged.split(",")]):
        n, m = staged + t, R * t
        q = torch.randn(H, t, D, device=dev, dtype=dt)  # [H, T, D]
        kt, vt = (torch.randn(G, n, D, device=dev, dtype=dt) for _ in range(2))  # [G, n, D] tree keys
        mask = torch.rand(t, n, device=dev) < 0.5
        mask[:, staged:] |= torch.eye(t, dtype=torch.bool, device=dev)  # each row sees itself
        bias = mask_bias(mask, R, torch.float32)  # [R*T, n]
        s = num_splits(m, G, sms)
        out_p = torch.empty(G, s, m, D, device=dev)  # [G, S, R*T, D]
        lse_p = torch.empty(G, s, m, device=dev)
        out = torch.empty(t, H * D, device=dev, dtype=dt)  # [T, H*D]
        for L in lengths:
            meta = torch.tensor(cache_meta(data, anchor, L), dtype=torch.int64, device=dev)
            cold = range(layers_for(L))

            def pair(layer, need_lse=False):
                prefix_partials(q.view(G, m, D), anchor, meta, layer, scale, out_p, lse_p)
                return tree_combine(q, kt, vt, bias, out_p, lse_p, scale, need_lse)

            def short(layer, need_lse=False, **cfg):
                return short_attention(q, anchor, meta, layer, kt, vt, bias, scale, need_lse, out, **cfg)

            ref, ref_lse = pair(0, True)
            got, got_lse = short(0, True)
            err = (got.float() - ref.float()).abs().max().item()
            lse_err = (got_lse - ref_lse).abs().max().item()
            ok = err <= 3e-2 and lse_err <= 1e-3  # bf16 outputs (a few ulps at |out| ~ 1); float32 lse
            row = dict(L=L, T=t, rows=m, n=n, splits=s, out_err=err, lse_err=lse_err, agree=ok,
                       pair_cold_us=timed([lambda i=i: pair(i) for i in cold]),
                       short_cold_us=timed([lambda i=i: short(i) for i in cold]),
                       pair_hot_us=timed([lambda: pair(0)]), short_hot_us=timed([lambda: short(0)]))
            if not ok:
                bad.append(row)
            for bm, bn, warps, stages in sweep:
                cfg = dict(bm=bm, block_n=bn, num_warps=warps, num_stages=stages)
                key = f"bm{bm}_bn{bn}_w{warps}_s{stages}"
                try:
                    swept, _ = short(0, True, **cfg)
                    if (swept.float() - ref.float()).abs().max().item() > 3e-2:
                        print(f"{key}: disagrees at L={L} T={t} n={n}")
                        continue
                    row[key] = timed([lambda i=i: short(i, **cfg) for i in cold])
                except Exception as e:  # noqa: BLE001 - a configuration the compiler rejects
                    print(f"{key}: {type(e).__name__}: {str(e)[:120]}")
            if sweep:
                best = min(((k, v) for k, v in row.items() if k.startswith("bm")), key=lambda kv: kv[1], default=None)
                row["best"] = best
            rows_out.append(row)
            print(f"L={L} T={t} n={n}: pair {row['pair_cold_us']:.2f} us, short {row['short_cold_us']:.2f} us"
                  f"{'' if ok else '  DISAGREE'}", flush=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter: nothing timed)"
    print(f"\n{name}, H={H} G={G} D={D} {dt}, short_attention default {short_config(R * 8, 24, D)}, "
          f"cold runs cycle {layers_for(max(lengths))}-{copies} cache layers, {time.perf_counter() - t0:.0f} s\n")
    print("| L | T | rows | n | splits | pair cold us | short cold us | pair hot us | short hot us | "
          "max out diff | max lse diff |" + (" best sweep config |" if sweep else ""))
    print("|---" * (11 + bool(sweep)) + "|")
    for r in rows_out:
        best = f" {r['best'][0]} {r['best'][1]:.2f} |" if sweep and r.get("best") else (" - |" if sweep else "")
        print(f"| {r['L']} | {r['T']} | {r['rows']} | {r['n']} | {r['splits']} | {r['pair_cold_us']:.2f} | "
              f"{r['short_cold_us']:.2f} | {r['pair_hot_us']:.2f} | {r['short_hot_us']:.2f} | "
              f"{r['out_err']:.1e} | {r['lse_err']:.1e} |{best}")
    print(json.dumps(dict(device=name, date=time.strftime("%Y-%m-%d"), H=H, G=G, D=D, dtype=str(dt),
                          sms=sms, l2_bytes=l2, rows=rows_out)))
    if bad:
        print(f"{len(bad)} shapes disagree", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
