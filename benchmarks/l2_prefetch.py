"""L2 prefetch of the weights ahead (models/l2_prefetch.py): does it land, and what it does to a
decode-time forward.

    python benchmarks/l2_prefetch.py                    # GPU: the draft level, the 1.5B AR step and verify

Part 1, one weight matrix (the 0.5B draft's gate/up, 17.4 MB): a 4-row linear after the L2 was
flushed, against the same after a prefetch launched `wait` microseconds before it (a device sleep):
how long a prefetch takes to land. Part 2, whole forwards (every layer and the head, the fused
full-step body captured as one CUDA graph, replayed between events) with the prefetch off and at
several leads, each forward's logits compared with the unprefetched ones (equal to the bit).
Prints tables; the JSON on the last line (and in --out).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from specextend.attention.backends import CAUSAL
from specextend.bench.kernels import copy_bandwidth, graph_us
from specextend.models.decoder import ForwardOptions
from specextend.models.full_graphs import FullStepGraphs
from specextend.models.l2_prefetch import L2Prefetch
from specextend.models.loader import load_model

MB = 1 << 20


def part1(reps: int, waits: list[int]) -> list[dict]:
    dev = torch.device("cuda")
    w = torch.randn(2 * 4864, 896, dtype=torch.bfloat16, device=dev)  # [2I, E] the 0.5B gate/up
    x = torch.randn(4, 896, dtype=torch.bfloat16, device=dev)
    flush = torch.empty(256 * MB, dtype=torch.uint8, device=dev)
    hz = 1.7e9  # about the SM clock under load: the sleeps are approximate
    rows = []
    for bulk in (True, False):
        pf = _one_region(w, bulk)
        for wait in waits:
            times = []
            for _ in range(reps):
                flush.zero_()
                if wait >= 0:
                    pf()
                torch.cuda._sleep(int(max(wait, 0) * 1e-6 * hz) + 1000)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                F.linear(x, w)
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1) * 1e3)
            rows.append(dict(prefetch=("bulk" if bulk else "lines") if wait >= 0 else "none", wait_us=max(wait, 0),
                             linear_us=statistics.median(times)))
    return rows


def _one_region(w: torch.Tensor, bulk: bool):
    """A launcher of the prefetch kernel over w alone (the module's kernel, one region)."""
    from specextend.models import l2_prefetch as lp

    table = torch.tensor([[w.data_ptr(), w.numel() * w.element_size() // 16 * 16]], dtype=torch.int64,
                         device=w.device)
    chunk = 16384 if bulk else 1024
    return lambda: lp._prefetch_kernel[(16,)](table, R=1, CHUNK=chunk, BLOCK=128, BULK=bulk, num_warps=4)


def part2(spec: str, rows: int, keys: int, variants: list[tuple], reps: int, bw: float) -> list[dict]:
    dec = load_model(spec, "draft", dtype="bfloat16", device="cuda", execution="eager").decoder
    cache = dec.new_cache(keys + 64)
    cache.data.normal_()
    cache.advance(keys)
    ids = torch.randint(0, dec.args.vocab_size, (rows,), device="cuda")
    pos = torch.arange(keys, keys + rows, device="cuda")
    a = dec.args
    floor_us = (a.num_params() * 2 + keys * a.kv_bytes_per_token(dec.dtype)) / bw * 1e6
    out, ref = [], None
    for name, lead, kw in variants:
        gr = FullStepGraphs(dec, capture=False, fused=True)
        gr.prefetch = None if lead is None else L2Prefetch(dec, lead, **kw)
        gr.forward(ids, pos, cache, CAUSAL, ForwardOptions())
        p = next(iter(gr.plans.values()))
        us = graph_us(lambda gr=gr, p=p: gr._body(p), reps)
        logits = p.logits.clone()
        ref = logits if ref is None else ref
        out.append(dict(model=spec, rows=rows, keys=keys, variant=name, us=us, floor_us=floor_us,
                        over_floor=us / floor_us, equal=bool(torch.equal(logits, ref)),
                        step_bytes_mb=None if gr.prefetch is None else [round(b / MB, 1) for b in gr.prefetch.bytes][:4]))
        del gr, p
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--waits", default="-1,0,5,10,20,40,80")
    ap.add_argument("--cases", default="random:qwen2.5-0.5b:4:1024,random:qwen2.5-1.5b:1:16384,random:qwen2.5-1.5b:17:16384")
    ap.add_argument("--leads", default="off,b0,b16,b32,l16,b16p32,b16p64", help="off | b<MB> (bulk) | l<MB> (lines), optional p<programs>, e (join once at the end)")
    ap.add_argument("--out")
    a = ap.parse_args()
    result = dict(part1=part1(a.reps, [int(x) for x in a.waits.split(",")]))
    print(f"{'prefetch':>8} {'wait us':>8} {'linear us':>10}")
    for r in result["part1"]:
        print(f"{r['prefetch']:>8} {r['wait_us']:>8} {r['linear_us']:>10.2f}")
    variants = []
    for v in a.leads.split(","):
        if v == "off":
            variants.append((v, None, {}))
            continue
        kind, rest = v[0], v[1:]
        join_each, rest = not rest.endswith("e"), rest.rstrip("e")  # suffix e: join at the end only
        mb, _, prog = rest.partition("p")
        variants.append((v, int(mb) * MB, dict(bulk=kind == "b", programs=int(prog) if prog else 16,
                                                join_each=join_each)))
    bw = copy_bandwidth(torch.device("cuda"))
    result["copy_bandwidth"] = bw
    result["part2"] = []
    for rnd in range(a.rounds):
        for case in a.cases.split(","):
            spec, rows, keys = case.rsplit(":", 2)
            for r in part2(spec, int(rows), int(keys), variants, a.reps, bw):
                r["round"] = rnd
                result["part2"].append(r)
                print(f"{rnd} {spec:>22} {rows:>3} rows {keys:>6} keys {r['variant']:>8}: {r['us']:8.1f} us "
                      f"({r['over_floor']:.2f}x floor {r['floor_us']:.0f}) equal={r['equal']} {r['step_bytes_mb']}",
                      flush=True)
    line = json.dumps(result)
    if a.out:
        open(a.out, "w").write(line)
    print(line)


if __name__ == "__main__":
    main()
