"""Device time of a decode-time forward's layers: the fused plan (ten kernels a layer) against the
persistent layer kernel (models/persistent.py), and each of its stages alone (one launch per
stage and layer), as CUDA graphs of every layer replayed, against the weights' floor.

    python benchmarks/persistent_layer.py --model random:qwen2.5-0.5b --rows 4 --keys 1024

Prints a table; the JSON on the last line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json

import torch

from specextend.attention.backends import CAUSAL
from specextend.bench.kernels import copy_bandwidth, graph_us
from specextend import pdl
from specextend.models import fused_layer, persistent, skinny
from specextend.models.decoder import ForwardOptions
from specextend.models.full_graphs import FullStepGraphs
from specextend.models.loader import load_model


CHOSEN: dict = {}  # row -> skinny.choices() after it


def setup(a):
    """The model and a committed cache of a.keys random keys -> (decoder, forward(persistent) ->
    (FullStepGraphs, its plan) after one uncaptured forward of a.rows queries)."""
    dec = load_model(a.model, "draft", dtype="bfloat16", device="cuda", execution="eager").decoder
    cache = dec.new_cache(a.keys + 64)
    cache.data.normal_()
    cache.advance(a.keys)
    ids = torch.randint(0, dec.args.vocab_size, (a.rows,), device="cuda")
    pos = torch.arange(a.keys, a.keys + a.rows, device="cuda")

    folded = copy.copy(dec)  # the same model with its norms folded (fused_layer.fold_model_norms)
    folded.w = dataclasses.replace(dec.w, layers=list(dec.w.layers))
    fused_layer.fold_model_norms(folded)

    def forward(persist: bool, skinny: bool = False, fold: bool = False):
        gr = FullStepGraphs(folded if fold else dec, capture=False, fused=True, persistent=persist, skinny=skinny)
        gr.forward(ids, pos, cache, CAUSAL, ForwardOptions())
        return gr, next(iter(gr.plans.values()))
    return dec, forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--rows", type=int, default=4, help="queries of the forward (a draft level: 4)")
    ap.add_argument("--keys", type=int, default=1024, help="committed keys (the draft's retrieval cache: ~1K)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiles", default="", help="BK:KS:warps[:programs per SM[:columns]],... : the persistent kernel's tiles to sweep")
    ap.add_argument("--pdl", default="auto", choices=("auto", "off", "late"),
                    help="off: no Programmatic Dependent Launch; late: skinny kernels signal after their main loop")
    a = ap.parse_args()
    if a.pdl == "off":
        pdl.SWITCH = False
    skinny.LATE_TRIGGER = a.pdl == "late"
    if a.tiles:
        return sweep(a)
    dec, forward = setup(a)
    args, t = dec.args, a.rows
    n = args.num_layers
    rows = []
    for name, persist, skinny_on in (("fused", False, False), ("fused, norms folded", False, "fold"),
                                     ("fused + skinny.choose", False, True),
                                     ("fused + skinny kernels only", False, "only"), ("persistent", True, False)):
        skinny.KERNELS_ONLY = skinny_on == "only"
        skinny._CHOICES.clear()
        gr, p = forward(persist, skinny_on in (True, "only"), skinny_on == "fold")
        us = graph_us(lambda gr=gr, p=p: gr._body(p, range(n)), a.reps)  # the layers, not the head
        rows.append(dict(what=f"{name}: {n} layers", us=us, per_layer_us=us / n))
        CHOSEN[name] = skinny.choices()
    for stage, what in enumerate(("qkv+rope", "prefix", "combine", "o-proj", "gate/up", "down"), start=1):
        def one(stage=stage):
            for i in range(args.num_layers):
                persistent.layer(gr, p, i, False, only=stage)
        us = graph_us(one, a.reps)
        rows.append(dict(what=f"stage {stage} {what} alone", us=us, per_layer_us=us / args.num_layers))
    lw = dec.w.layers[0]
    layer_bytes = sum(x.numel() * x.element_size() for x in (lw.qkv, lw.o, lw.gate_up, lw.down))
    floor = layer_bytes / copy_bandwidth(torch.device("cuda")) * 1e6  # read at a copy's byte rate
    rows.append(dict(what="floor: one layer's weights at the copy bandwidth", us=floor * args.num_layers,
                     per_layer_us=floor))
    print(f"{a.model}, {t} rows, {a.keys} keys, {torch.cuda.get_device_name()}")
    for name, c in CHOSEN.items():
        print(name, c)
    print("| what | us | us per layer |\n|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['us']:.1f} | {r['per_layer_us']:.2f} |")
    print(json.dumps(dict(model=a.model, rows=t, keys=a.keys, device=torch.cuda.get_device_name(), table=rows)))


def sweep(a) -> None:
    """The persistent layers at each tile of --tiles (persistent.BLOCK_K, K_STAGES, NUM_WARPS, PER_SM,
    BLOCK_COLS)."""
    dec, forward = setup(a)
    n = dec.args.num_layers
    cols = persistent.BLOCK_COLS
    out = []
    for tile in ["fused"] + a.tiles.split(","):
        if tile != "fused":
            v = list(map(int, tile.split(":")))
            persistent.BLOCK_K, persistent.K_STAGES, persistent.NUM_WARPS = v[:3]
            persistent.PER_SM = v[3] if len(v) > 3 else 1
            persistent.BLOCK_COLS = v[4] if len(v) > 4 else cols
        gr, p = forward(tile != "fused")
        gr.num_sms = 0  # the launch's programs from persistent.PER_SM (the plan's splits are made)
        us = graph_us(lambda: gr._body(p, range(n)), a.reps)
        out.append(dict(tile=tile, us=us, per_layer_us=us / n))
        print(f"| {tile} | {us:.1f} | {us / n:.2f} |", flush=True)
    print(json.dumps(dict(model=a.model, rows=a.rows, keys=a.keys, device=torch.cuda.get_device_name(), sweep=out)))


if __name__ == "__main__":
    main()
