"""Decode-time attention of the fused plan, per layer: the split-KV prefix kernel
(attention/triton_prefix.prefix_partials) then the tree part and merge (fused_layer.tree_combine),
as a forward runs them (PDL where the device has it), against the bytes floor.

  python benchmarks/decode_attention.py                 # the default cases, a sweep each
  python benchmarks/decode_attention.py --cases 1.5b:16384:1 --json out.json
  python benchmarks/decode_attention.py --compare      # the merge's two ways to read the splits, twice
  python benchmarks/decode_attention.py --split        # the prefix kernel and the merge apart

A case is GEOMETRY:L:T (1.5b, 0.5b, 8b; L committed keys; T new tokens). For each case: the
production configuration, then the merge's splits-per-iteration `sb` and warps, then the split
count S around the production one (num_splits), each checked against a float32 reference of the
whole attention (relative error) and timed as CUDA-graph replays over enough layers' caches to
pass the L2 (us per layer, median). Floor: K and V read once at the copy bandwidth measured here.
The sweep ends with a table and a JSON line of each case's best; `--json` writes every row.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

import torch

from specextend.attention.tree_merge import mask_bias
from specextend.attention.triton_prefix import cache_meta, num_splits, prefix_partials
from specextend.bench.kernels import copy_bandwidth, graph_us
from specextend.bench.record import meta
from specextend.models import fused_layer

GEOMETRY = {"1.5b": (12, 2), "0.5b": (14, 2), "8b": (32, 8)}  # (query heads H, KV heads G); D = 128
DEFAULT_CASES = "1.5b:16384:1,1.5b:30000:1,1.5b:16384:8,1.5b:16384:16,0.5b:1024:8,8b:16384:1"


def build(geom: str, L: int, T: int, dev, dt=torch.bfloat16, l2_bytes: int = 60 << 20):
    H, G = GEOMETRY[geom]
    D = 128
    R = H // G
    per_layer = 2 * G * (L + 64) * D * 2
    layers = max(2, min(256, -(-3 * l2_bytes // per_layer)))  # caches past the L2
    data = torch.randn(layers, 2, G, L + 64, D, device=dev, dtype=dt)  # [layers, 2, G, capacity, D]
    anchor = torch.zeros(16, dtype=dt, device=dev)
    meta = torch.tensor(cache_meta(data, anchor, L), dtype=torch.int64, device=dev)
    q = torch.randn(H, T, D, device=dev, dtype=dt)  # [H, T, D]
    kt = torch.randn(G, T, D, device=dev, dtype=dt)  # [G, T, D] the new tokens' keys
    vt = torch.randn(G, T, D, device=dev, dtype=dt)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev))  # a chain: every node sees its ancestors
    bias = mask_bias(mask, R, torch.float32).contiguous()  # [R*T, T]
    return dict(H=H, G=G, D=D, R=R, L=L, T=T, layers=layers, data=data, anchor=anchor, meta=meta, q=q, kt=kt,
                vt=vt, bias=bias, scale=1 / math.sqrt(D), kv_bytes=2 * G * L * D * 2)


def reference(c, layer: int) -> torch.Tensor:
    """[T, H * D] float32: softmax over the L prefix keys and the masked tree keys."""
    G, R, T, D, L = c["G"], c["R"], c["T"], c["D"], c["L"]
    k = torch.cat([c["data"][layer, 0, :, :L], c["kt"]], 1).float()  # [G, L + T, D]
    v = torch.cat([c["data"][layer, 1, :, :L], c["vt"]], 1).float()
    qg = c["q"].float().reshape(G, R * T, D)
    s = torch.einsum("gmd,gnd->gmn", qg, k) * c["scale"]  # [G, R*T, L + T]
    s[..., L:] += c["bias"]
    out = torch.einsum("gmn,gnd->gmd", torch.softmax(s, -1), v)  # [G, R*T, D] rows (j, t)
    return out.reshape(G, R, T, D).permute(2, 0, 1, 3).reshape(T, G * R * D)


def kernels(c, S: int, prefix: Optional[dict] = None, merge: Optional[dict] = None):
    """(prefix(layer), merge(layer)) over one pair of S-split partial buffers: the prefix kernel with
    launch parameters `prefix` (block_n, num_warps, num_stages) and the merge with `merge` (sb,
    warps); those left out are production's."""
    G, R, T, D = c["G"], c["R"], c["T"], c["D"]
    out_p = torch.zeros(G, S, R * T, D, device=c["q"].device, dtype=torch.float32)
    lse_p = torch.zeros(G, S, R * T, device=c["q"].device, dtype=torch.float32)
    qf = c["q"].view(G, R * T, D)

    def run_prefix(layer: int):
        prefix_partials(qf, c["anchor"], c["meta"], layer, c["scale"], out_p, lse_p, **(prefix or {}))

    def run_merge(layer: int) -> torch.Tensor:  # the new tokens' K/V from scratch, as the forward's
        return fused_layer.tree_combine(c["q"], c["kt"], c["vt"], c["bias"], out_p, lse_p, c["scale"], **(merge or {}))[0]
    return run_prefix, run_merge


def variant(c, S: int, prefix: Optional[dict] = None, merge: Optional[dict] = None):
    """(run(layer): the prefix kernel then the merge, its relative error against `reference`)."""
    run_prefix, run_merge = kernels(c, S, prefix, merge)

    def run(layer: int) -> torch.Tensor:
        run_prefix(layer)
        return run_merge(layer)

    layer = c["layers"] // 2
    got = run(layer).float()
    ref = reference(c, layer)
    return run, ((got - ref).norm() / ref.norm()).item()


def setup(case: str, bw: float, sms: int):
    """A case's tensors, its production split count and its floor (K and V read once at the copy's
    bytes moved, read + write, a second)."""
    geom, L, T = case.split(":")
    c = build(geom, int(L), int(T), torch.device("cuda"))
    return c, num_splits(c["R"] * c["T"], c["G"], sms), c["kv_bytes"] / bw * 1e6


def split_sweep(case: str, bw: float, sms: int) -> list[dict]:
    """The prefix kernel alone over its launch parameters, and the merge alone."""
    c, S0, floor_us = setup(case, bw, sms)
    rows = []
    for S in (S0 // 2, S0):
        for bn, warps, stages in ((0, 0, 0), (32, 4, 3), (128, 4, 3), (64, 8, 3), (64, 4, 2), (64, 4, 4),
                                  (128, 8, 2)):
            prefix, merge = kernels(c, S, dict(block_n=bn, num_warps=warps, num_stages=stages))
            try:
                us = time_us(c, prefix)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
                print(f"{case:16s} prefix S={S:3d} bn={bn} w={warps} st={stages}: {type(e).__name__}")
                continue
            rows.append(dict(case=case, part="prefix", S=S, bn=bn, warps=warps, stages=stages, us=us,
                             floor_us=floor_us))
            print(f"{case:16s} prefix S={S:3d} bn={bn or '-':>3} w={warps or '-':>2} st={stages or '-':>2}"
                  f"  {us:7.2f} us  ({us / floor_us:5.2f}x floor {floor_us:5.2f})", flush=True)
        us = time_us(c, merge)
        rows.append(dict(case=case, part="merge", S=S, us=us))
        print(f"{case:16s} merge  S={S:3d}  {us:7.2f} us", flush=True)
    return rows


def time_us(c, run) -> float:
    n = c["layers"]

    def all_layers():
        for i in range(n):
            run(i)
    return graph_us(all_layers, reps=10, per_graph=1, warmup=2) / n


def merges(S: int) -> tuple[tuple[str, dict], ...]:
    """The merge's two ways to read the S splits' outputs (fused_layer.tree_combine's sb): 8 splits
    an iteration, or every split in one load."""
    sp = max(2, 1 << (S - 1).bit_length())
    return ("8 a round", dict(sb=min(8, sp))), ("one load", dict(sb=sp))


def compare(case: str, bw: float, sms: int) -> list[dict]:
    """The merge's two ways (`merges`), twice, the pair (prefix + merge) a layer."""
    c, S, floor_us = setup(case, bw, sms)
    rows = []
    for label, merge in merges(S) * 2:
        run, err = variant(c, S, merge=merge)
        us = time_us(c, run)
        rows.append(dict(case=case, variant=label, S=S, us=us, floor_us=floor_us, rel_err=err))
        print(f"{case:16s} {label:11s} S={S:3d}  {us:7.2f} us  ({us / floor_us:5.2f}x floor {floor_us:5.2f})"
              f"  err {err:.1e}", flush=True)
    return rows


def sweep(case: str, bw: float, sms: int) -> list[dict]:
    c, S0, floor_us = setup(case, bw, sms)
    rows = []

    def add(label, S, sb=0, warps=0):
        run, err = variant(c, S, merge=dict(sb=sb, warps=warps))
        us = time_us(c, run)
        rows.append(dict(case=case, variant=label, S=S, sb=sb, warps=warps, us=us, floor_us=floor_us,
                         x_floor=us / floor_us, rel_err=err, layers=c["layers"]))
        print(f"{case:16s} {label:22s} S={S:3d} sb={sb or '-':>3} w={warps or '-':>2}  {us:7.2f} us"
              f"  ({us / floor_us:5.2f}x floor {floor_us:5.2f})  err {err:.1e}", flush=True)
    add("production", S0)
    for sb in (8, 16, 32, 64):  # (sb >= the split count: every split in one load)
        if sb <= max(S0, 2):
            add("merge sb", S0, sb)
    for warps in (2, 8):
        add("merge warps", S0, 0, warps)
    best = min(rows, key=lambda r: r["us"])
    for S in sorted({max(1, S0 // 4), max(1, S0 // 2), S0 * 2}):
        add("splits", S, min(best["sb"], S) if best["sb"] else 0, best["warps"])
        add("splits, sb = S", S, max(2, 1 << (S - 1).bit_length()), best["warps"])
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--json", default="")
    p.add_argument("--split", action="store_true", help="time the prefix kernel and the merge apart")
    p.add_argument("--compare", action="store_true", help="the merge 8 splits a round against one load, twice")
    a = p.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}: copy {bw / 1e12:.2f} TB/s (read + write), {sms} SMs")
    rows = []
    for case in a.cases.split(","):
        rows += (split_sweep if a.split else compare if a.compare else sweep)(case, bw, sms)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta("decode_attention", "cuda", sys.argv), copy_bw=bw, rows=rows), f, indent=1)
    if a.split or a.compare:
        return
    best = {}
    for r in rows:
        if r["rel_err"] < 1e-2 and (r["case"] not in best or r["us"] < best[r["case"]]["us"]):
            best[r["case"]] = r
    print("\n| case | production us | best us | best | floor us |\n|---|---|---|---|---|")
    for case, b in best.items():
        prod = next(r for r in rows if r["case"] == case and r["variant"] == "production")
        print(f"| {case} | {prod['us']:.2f} | {b['us']:.2f} | S={b['S']} sb={b['sb']} w={b['warps']} | {b['floor_us']:.2f} |")
    print(json.dumps(dict(best={k: [v["us"], v["S"], v["sb"], v["warps"]] for k, v in best.items()})))


if __name__ == "__main__":
    main()
