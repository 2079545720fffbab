"""The skinny linear kernel (models/skinny.py) against the ops it replaces (cuBLAS GEMMs + the RMSNorm /
SiLU / bias kernels), at the draft's and small targets' decode shapes: every tile that skinny.choose
weighs at start-up, with and without Programmatic Dependent Launch, plus a wider sweep with --sweep.

    python benchmarks/skinny_tune.py [--sweep] [--streamed] [--out FILE.json]

--streamed adds the streamed kernel's tiles (skinny_loop: bn x bk x split x warps); with many tiles,
compile them first in parallel processes (`--compile-only --shard i/n`, Triton's cache keeps them)
so that the timed run compiles nothing.

Each timing is skinny.time_op's: the median of CUDA-graph replays of one call per weight copy, the
copies together twice the L2 cache (a forward reads each layer's weights from memory), so launch
gaps count as they do in the step graphs. The floor is the weights at the measured copy bandwidth.
Prints a table (the choice and its time against torch and the floor per shape) and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from specextend import pdl
from specextend.bench import record
from specextend.models import fused_layer, skinny

# name: (T, N, K, kind): qkv (norm + bias), glu (norm, gate|up: N is I), res (linear + residual)
SHAPES = {
    "0.5b-level-qkv": (4, 1152, 896, "qkv"), "0.5b-level-glu": (4, 4864, 896, "glu"),
    "0.5b-level-o": (4, 896, 896, "res"), "0.5b-level-down": (4, 896, 4864, "res"),
    "0.5b-8-glu": (8, 4864, 896, "glu"), "0.5b-16-glu": (16, 4864, 896, "glu"),
    "0.5b-16-qkv": (16, 1152, 896, "qkv"), "0.5b-16-down": (16, 896, 4864, "res"),
    "1.5b-ar-qkv": (1, 2048, 1536, "qkv"), "1.5b-ar-glu": (1, 8960, 1536, "glu"),
    "1.5b-ar-o": (1, 1536, 1536, "res"), "1.5b-ar-down": (1, 1536, 8960, "res"),
    "1.5b-verify-qkv": (17, 2048, 1536, "qkv"), "1.5b-verify-glu": (17, 8960, 1536, "glu"),
    "1.5b-verify-o": (17, 1536, 1536, "res"), "1.5b-verify-down": (17, 1536, 8960, "res"),
}


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / skinny.time_op(lambda _: b.copy_(a), [a])


def streamed_tiles(kind: str, t: int, n: int, k: int) -> list:
    """The streamed kernel's grid: column blocks x loop steps x splits x warps x stages, each
    effective split once (k_slice), at least 32 and at most 1,024 programs."""
    out = []
    for bn, bk, split, warps, stages in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8), (4, 8), (3, 4)):
        c = skinny.Tile(bn, split, warps, bk, stages)
        ks, _, eff = skinny.k_slice(kind, t, k, c)
        programs = -(-n // bn) * eff
        if eff == split and 32 <= programs <= 1024 and ks >= bk:
            out.append(c)
    return out


def persistent_tiles(kind: str, t: int, n: int, k: int, sms: int) -> list:
    """The persistent kernel's grid (skinny_tiles): column blocks x K chunk x stages x warps x
    programs (one or two per multiprocessor, or the fewest that keep every program's count of
    blocks equal but for the last), each where it has fewer programs than column blocks."""
    out = []
    for bn, bk, stages, warps in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 6), (4, 8)):
        blocks = -(-n // bn)
        per = -(-blocks // sms)
        for progs in sorted({sms, 2 * sms, -(-blocks // per)}):
            if progs < blocks and bk <= skinny._pow2(k):
                out.append(skinny.Tile(bn, 1, warps, bk, stages, progs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also every tile of a wider grid")
    ap.add_argument("--streamed", action="store_true", help="also the streamed kernel's tiles")
    ap.add_argument("--persistent", action="store_true", help="also the persistent kernel's tiles")
    ap.add_argument("--shapes", default="", help="comma-separated names of SHAPES (default all)")
    ap.add_argument("--compile-only", action="store_true", help="run each tile once, time nothing")
    ap.add_argument("--shard", default="0/1", help="i/n: this process's share of the tiles (--compile-only)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    shard, shards = map(int, a.shard.split("/"))
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth() if not a.compile_only else 1.0
    rows = []
    job = 0
    for name, (t, n, k, kind) in SHAPES.items():
        if a.shapes and name not in a.shapes.split(","):
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(t, k, device=dev, generator=g).to(dt)
        nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt)
        b = torch.randn(n, device=dev, generator=g).to(dt) if kind == "qkv" else None
        y = torch.randn(t, n, device=dev, generator=g).to(dt)
        w = torch.empty(2 * n if kind == "glu" else n, k, device=dev, dtype=dt)
        copies = skinny._weight_copies(w)
        if kind == "qkv":
            def twin(ww):
                F.linear(fused_layer.rms_norm(x, nw, 1e-6), ww, b)

            def kern(ww, c):
                skinny.norm_linear(x, nw, 1e-6, ww, b, c)
        elif kind == "glu":
            def twin(ww):
                fused_layer.silu_mul(F.linear(fused_layer.rms_norm(x, nw, 1e-6), ww))

            def kern(ww, c):
                skinny.norm_glu(x, nw, 1e-6, ww, c)
        else:
            def twin(ww):
                y.addmm_(x, ww.t())

            def kern(ww, c):
                skinny.linear_residual_(y, x, ww, c)
        cands = skinny.candidates(kind, t, n, k, torch.cuda.get_device_properties(dev).multi_processor_count)
        tiles = list(cands)
        if a.sweep:
            tiles += [skinny.Tile(bn, s, wp) for bn, s, wp in itertools.product((16, 32, 64), (1, 2, 3, 4, 6, 8, 12, 16, 24),
                                                                                  (4, 8))]
        if a.streamed:
            tiles += streamed_tiles(kind, t, n, k)
        if a.persistent:
            tiles += persistent_tiles(kind, t, n, k, torch.cuda.get_device_properties(dev).multi_processor_count)
        tiles = list(dict.fromkeys(tiles))
        if a.compile_only:
            for c in tiles:
                job += 1
                if job % shards == shard:
                    try:
                        kern(copies[0], c)
                    except Exception as e:  # noqa: BLE001 - reported by the timed run
                        print(name, c, type(e).__name__)
            torch.cuda.synchronize()
            continue
        row = dict(shape=name, t=t, n=n, k=k, kind=kind, floor_us=w.numel() * 2 / bw * 1e6,
                   torch_us=skinny.time_op(twin, copies) * 1e6, tiles=[])
        both = pdl.enabled(dev) and not (a.streamed or a.persistent)  # (with and without PDL)
        for c, on in itertools.product(tiles, (False, True) if both else (pdl.enabled(dev),)):
            pdl.SWITCH = None if on else False
            try:
                us = skinny.time_op(lambda ww, c=c: kern(ww, c), copies) * 1e6
            except Exception as e:  # noqa: BLE001 - out of resources: reported
                us = float("nan")
                print(name, c, type(e).__name__)
            row["tiles"].append(dict(bn=c.bn, split=c.split, warps=c.warps, bk=c.bk, stages=c.stages, pdl=on, us=us,
                                     programs=c.programs,
                                     candidate=c in cands))
        pdl.SWITCH = None
        ok = [r for r in row["tiles"] if r["us"] == r["us"]]
        row["best"] = min(ok, key=lambda r: r["us"])
        row["best_candidate"] = min((r for r in ok if r["candidate"] and r["pdl"] == pdl.enabled(dev)),
                                    key=lambda r: r["us"])
        row["best_no_pdl"] = min((r for r in ok if not r["pdl"]), key=lambda r: r["us"], default=row["best"])
        row["best_streamed"] = min((r for r in ok if r["bk"] and not r["programs"]), key=lambda r: r["us"],
                                   default=row["best"])
        row["best_persistent"] = min((r for r in ok if r["programs"]), key=lambda r: r["us"], default=row["best"])
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    if a.compile_only:
        return
    print(f"\n{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, bf16")
    print("| shape | T | N | K | floor us | torch us | without PDL us | start-up choice us | best us | "
          "(tiles: bn/split/warps) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, s, n = r["best_candidate"], r["best"], r["best_no_pdl"]
        print(f"| {r['shape']} | {r['t']} | {r['n']} | {r['k']} | {r['floor_us']:.1f} | {r['torch_us']:.1f} | "
              f"{n['us']:.1f} | {c['us']:.1f} | {s['us']:.1f} | {n['bn']}/{n['split']}/{n['warps']} "
              f"{c['bn']}/{c['split']}/{c['warps']} {s['bn']}/{s['split']}/{s['warps']}/{s['bk']}{' pdl' if s['pdl'] else ''} |")
    if a.streamed:
        print("\n| shape | floor us | torch us | best streamed us | x floor | x torch | bn/split/warps/bk/stages |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            b = r["best_streamed"]
            print(f"| {r['shape']} | {r['floor_us']:.1f} | {r['torch_us']:.1f} | {b['us']:.1f} | "
                  f"{b['us'] / r['floor_us']:.2f} | {b['us'] / r['torch_us']:.2f} | "
                  f"{b['bn']}/{b['split']}/{b['warps']}/{b['bk']}/{b['stages']} |")
    if a.persistent:
        print("\n| shape | floor us | torch us | best streamed us | best persistent us | x floor | x torch | "
              "bn/warps/bk/stages/programs |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            b, st = r["best_persistent"], r["best_streamed"]
            print(f"| {r['shape']} | {r['floor_us']:.1f} | {r['torch_us']:.1f} | {st['us']:.1f} | {b['us']:.1f} | "
                  f"{b['us'] / r['floor_us']:.2f} | {b['us'] / r['torch_us']:.2f} | "
                  f"{b['bn']}/{b['warps']}/{b['bk']}/{b['stages']}/{b['programs']} |")
    out = dict(suite="skinny_tune", commit=record.commit(), date=datetime.date.today().isoformat(),
               command="python " + " ".join(sys.argv), device=torch.cuda.get_device_name(), copy_bandwidth_Bps=bw,
               rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
