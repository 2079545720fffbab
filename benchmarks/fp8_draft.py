"""Weight-only float8 for the draft's projections (models/skinny.py `scale=`), against the bf16 ops a
draft forward runs today (cuBLAS + the norm / SiLU kernels) and the bf16 streamed kernel, at the
0.5B draft's shapes: a tree level (4 rows), a background forward (8 rows), and the lm_head.

    python benchmarks/fp8_draft.py [--rows 4,8] [--compile-only --shard i/n] [--out FILE.json]

Compile first in parallel processes (`--compile-only --shard i/n`, Triton's cache keeps the
kernels) so that the timed run compiles nothing. Each timing is skinny.time_op's: the median of
CUDA-graph replays of one call per weight copy, the copies together twice the L2 cache (a forward
reads each layer's weights from memory). The floor is the weights' bytes at the measured copy
bandwidth. Prints a table and what a whole draft forward's projections would take (24 layers +
the lm_head), and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from specextend.bench import record
from specextend.models import fused_layer, skinny

LAYERS = 24  # the 0.5B draft (Qwen2.5-Coder-0.5B)
# name: (N, K, kind); kind: qkv (norm + bias), glu (norm, gate|up: N is I), res (linear + residual),
# head (the final norm + lm_head, no bias)
SHAPES = {"qkv": (1152, 896, "qkv"), "glu": (4864, 896, "glu"), "o": (896, 896, "res"),
          "down": (896, 4864, "res"), "head": (151936, 896, "head")}


def tiles(n: int, k: int, fp8: bool) -> list[skinny.Tile]:
    out = []
    for bn, bk, stages in itertools.product((16, 32, 64) if fp8 else (16, 32), (256, 512) if fp8 else (128, 256),
                                            (3, 4) if fp8 else (3,)):
        if bk > k:
            continue
        auto = skinny.streamed_tile(n, k, bn, bk)
        for split in dict.fromkeys((auto.split, max(1, auto.split // 2), 1)):
            out.append(skinny.Tile(bn, split, 4, bk, stages))
    return list(dict.fromkeys(out))


def make(kind: str, t: int, n: int, k: int, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(t, k, device=dev, generator=g).to(dt)
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt)
    b = torch.randn(n, device=dev, generator=g).to(dt) if kind == "qkv" else None
    y = torch.randn(t, n, device=dev, generator=g).to(dt)
    rows = 2 * n if kind == "glu" else n
    copies = skinny._weight_copies(torch.empty(rows, k, device=dev, dtype=dt))
    quant = [skinny.quantize_rows(w) for w in copies]  # [(w8 [rows, k], scale [rows])]

    if kind in ("qkv", "head"):
        def twin(ww):
            F.linear(fused_layer.rms_norm(x, nw, 1e-6), ww, b)

        def kern(ww, c, s=None):
            skinny.norm_linear(x, nw, 1e-6, ww, b, c, scale=s)
    elif kind == "glu":
        def twin(ww):
            fused_layer.silu_mul(F.linear(fused_layer.rms_norm(x, nw, 1e-6), ww))

        def kern(ww, c, s=None):
            skinny.norm_glu(x, nw, 1e-6, ww, c, scale=s)
    else:
        def twin(ww):
            y.addmm_(x, ww.t())

        def kern(ww, c, s=None):
            skinny.linear_residual_(y, x, ww, c, scale=s)
    return copies, quant, twin, kern


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,8")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    shard, shards = map(int, a.shard.split("/"))
    dev = torch.device("cuda")
    bw = 1.0
    if not a.compile_only:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        bw = 2 * src.numel() / skinny.time_op(lambda _: dst.copy_(src), [src])
        del src, dst
    rows, job = [], 0
    for t in map(int, a.rows.split(",")):
        for name, (n, k, kind) in SHAPES.items():
            copies, quant, twin, kern = make(kind, t, n, k, dev)
            wrows = copies[0].shape[0]
            work = [(c, False) for c in tiles(n, k, False)] + [(c, True) for c in tiles(n, k, True)]
            if a.compile_only:
                for c, fp8 in work:
                    job += 1
                    if job % shards == shard:
                        try:
                            kern(*quant[0], c) if fp8 else kern(copies[0], c)
                        except Exception as e:  # noqa: BLE001 - reported by the timed run
                            print(t, name, c, fp8, type(e).__name__)
                torch.cuda.synchronize()
                continue
            row = dict(shape=name, t=t, n=n, k=k, kind=kind, floor_bf16_us=wrows * k * 2 / bw * 1e6,
                       floor_fp8_us=wrows * k / bw * 1e6, torch_us=skinny.time_op(twin, copies) * 1e6, tiles=[])
            w8s = [q[0] for q in quant]
            scales = {q[0].data_ptr(): q[1] for q in quant}
            for c, fp8 in work:
                try:
                    if fp8:
                        us = skinny.time_op(lambda ww, c=c: kern(ww, c, scales[ww.data_ptr()]), w8s) * 1e6
                    else:
                        us = skinny.time_op(lambda ww, c=c: kern(ww, c), copies) * 1e6
                except Exception as e:  # noqa: BLE001 - out of resources: reported
                    print(t, name, c, fp8, type(e).__name__)
                    continue
                row["tiles"].append(dict(bn=c.bn, split=c.split, warps=c.warps, bk=c.bk, stages=c.stages, fp8=fp8,
                                         us=us))
            row["best_bf16"] = min((r for r in row["tiles"] if not r["fp8"]), key=lambda r: r["us"])
            row["best_fp8"] = min((r for r in row["tiles"] if r["fp8"]), key=lambda r: r["us"])
            rows.append(row)
            del copies, quant, w8s
            torch.cuda.empty_cache()
    if a.compile_only:
        return
    print(f"\n{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| T | shape | N | K | floor bf16 us | floor fp8 us | torch bf16 us | streamed bf16 us | streamed fp8 us "
          "| fp8 tile bn/split/bk/stages |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, f = r["best_bf16"], r["best_fp8"]
        print(f"| {r['t']} | {r['shape']} | {r['n']} | {r['k']} | {r['floor_bf16_us']:.1f} | {r['floor_fp8_us']:.1f} | "
              f"{r['torch_us']:.1f} | {b['us']:.1f} | {f['us']:.1f} | {f['bn']}/{f['split']}/{f['bk']}/{f['stages']} |")
    for t in sorted({r["t"] for r in rows}):
        per = {r["shape"]: r for r in rows if r["t"] == t}

        def total(key):
            return sum(LAYERS * (min(per[s]["torch_us"], per[s][key]["us"]) if key else per[s]["torch_us"])
                       for s in ("qkv", "glu", "o", "down")) + \
                (min(per["head"]["torch_us"], per["head"][key]["us"]) if key else per["head"]["torch_us"])
        print(f"T={t}: a draft forward's projections (24 layers + lm_head): torch {total(None):.0f} us, "
              f"best of torch/bf16 streamed {total('best_bf16'):.0f} us, best of torch/fp8 {total('best_fp8'):.0f} us")
    out = dict(suite="fp8_draft", commit=record.commit(), date=datetime.date.today().isoformat(),
               command="python " + " ".join(sys.argv), device=torch.cuda.get_device_name(), copy_bandwidth_Bps=bw,
               rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
