"""Step-level timings at scale (docs/architecture.md, "Baselines"): prefill, verify (HTA vs plain masked), AR decode and
draft steps (retrieval working cache vs full cache), each against its memory floor.

Random weights at real geometries (every kernel's time is what it would be with real weights).
Prints a table and the full JSON on the last line.

  python benchmarks/step_times.py --target random:llama-3.1-8b --draft random:llama-68m \
      --lengths 4096,8192,16384,32768
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specextend.attention.backends import get_backend
from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.session import DraftSession
from specextend.models.loader import load_model
from specextend.target import TargetSession


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, reps: int, warmup: int = 2) -> float:
    """Median wall time (s) of fn() with the device synchronized around each call."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def copy_bandwidth(dev) -> float:
    """Bytes read + written per second of a large device copy."""
    n = (1 << 30) if dev.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), dev, 10)
    return 2 * n / t


def fixed_tree(nodes: int, topk: int) -> list[int]:
    """A dense tree: each level's first `topk` nodes get `topk` children, until `nodes` nodes."""
    parents, frontier = [], [-1]
    while len(parents) < nodes:
        nxt = []
        for p in frontier[:topk]:
            for _ in range(topk):
                if len(parents) < nodes:
                    parents.append(p)
                    nxt.append(len(parents) - 1)
        frontier = nxt
    return parents


def host_time(fn, dev, reps: int) -> float:
    """Median time for fn() to return with an idle device before it (its launch cost, no sync after)."""
    out = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    sync(dev)
    return statistics.median(out)


def set_graphs(models, mode: str, store: dict) -> None:
    """Each decoder's decode-time forwards: op by op ("off"), piecewise CUDA graphs (models/graphs.py,
    "on"), or those graphs with Inductor-compiled segments ("compiled"); one graph per forward
    (full_graphs.py: "full"), with Inductor ("full-compiled") or with the Triton-fused layer kernels
    of fused_layer.py ("full-fused"; "full-fused-1": in one launch, not split_launch's few)."""
    from specextend.models.full_graphs import FullStepGraphs
    from specextend.models.graphs import StepGraphs

    make = {"on": lambda d: StepGraphs(d), "compiled": lambda d: StepGraphs(d, compile=True),
            "full": lambda d: FullStepGraphs(d), "full-compiled": lambda d: FullStepGraphs(d, compile=True),
            "full-fused": lambda d: FullStepGraphs(d, fused=True),
            "full-fused-1": lambda d: FullStepGraphs(d, fused=True, split_launch=False)}
    for m in models:
        dec = m.decoder
        if mode != "off" and (id(dec), mode) not in store:
            store[id(dec), mode] = make[mode](dec)
        dec.graphs = store.get((id(dec), mode))


def bench_length(target, draft, L, a, dev, bw, results, graphs: str = "off", prefill: bool = True):
    dec = target.decoder
    args = dec.args
    gen = torch.Generator().manual_seed(L)
    prompt = torch.randint(0, 256, (L,), generator=gen).tolist()
    weight_bytes = args.num_params() * dec.w.embed.element_size()
    kv_tok = args.kv_bytes_per_token(dec.dtype)
    row = dict(length=L, cuda_graphs=graphs != "off", torch_compile=graphs.endswith("compiled"), graphs=graphs)
    # prefill (torch kernels; eager where it fits)
    sess = TargetSession(dec, L + 128, hybrid=True)
    reps = 2 if prefill else 1
    row["prefill_s"] = timed(lambda: (sess.cache.truncate(0), sess.prefill(prompt, a.prefill_chunk)), dev, reps,
                             reps - 1)
    if prefill and L <= a.eager_max:
        eager = get_backend("eager", dev)
        fast = dec.backend
        dec.backend = eager
        row["prefill_eager_s"] = timed(lambda: (sess.cache.truncate(0), sess.prefill(prompt, a.prefill_chunk)),
                                       dev, 1, 1)
        dec.backend = fast
    # AR decode step over L committed tokens
    def ar_step():
        sess.decode(7)
        sess.cache.truncate(L)
    row["ar_step_s"] = timed(ar_step, dev, a.reps)
    with torch.inference_mode():  # as the engine runs it
        row["ar_step_inference_mode_s"] = timed(ar_step, dev, a.reps)
        sess.hybrid = False
        row["verify_plain_inference_mode_s"] = timed(
            lambda: sess.verify(5, [11] * a.tree_nodes, fixed_tree(a.tree_nodes, a.tree_topk), capture=False), dev, a.reps)
        sess.hybrid = True
    row["floor_s"] = (weight_bytes + L * kv_tok) / bw
    # verify step: [root] + tree of N nodes, HTA vs plain masked; nothing committed
    parents = fixed_tree(a.tree_nodes, a.tree_topk)
    tokens = [11] * len(parents)
    for hybrid in (True, False):
        sess.hybrid = hybrid
        t = timed(lambda: sess.verify(5, tokens, parents, capture=False), dev, a.reps)
        row["verify_hta_s" if hybrid else "verify_plain_s"] = t
        if hybrid:  # launch cost alone: near the total = host-bound
            row["verify_hta_host_s"] = host_time(lambda: sess.verify(5, tokens, parents, capture=False),
                                                 dev, a.reps)
    sess.hybrid = True
    row["verify_floor_s"] = (weight_bytes + (L + len(parents) + 1) * kv_tok) / bw
    # draft step: full cache vs retrieval working cache (budget retrieval_top_k * chunk)
    tree = TreeConfig(a.tree_nodes, a.tree_depth, a.tree_topk)
    for name, retr in (("full", RetrievalConfig()),
                       ("cmr", RetrievalConfig(enabled=True, top_k=a.retrieval_top_k, draft_prefill_window=512))):
        ds = DraftSession(draft.decoder, prompt, DraftSessionParams(tree, retr, max_new_tokens=4 * a.reps + 64),
                          prefill_chunk=a.prefill_chunk)
        k = [0]

        def step():
            ds.step(k[0], [3], None)
            k[0] += 1
        sync(dev)
        t0 = time.perf_counter()
        step()  # the session's first step (captures its graphs where they are per session)
        sync(dev)
        row[f"draft_first_step_{name}_s"] = time.perf_counter() - t0
        row[f"draft_step_{name}_s"] = timed(step, dev, a.reps)
        row[f"draft_cache_{name}"] = ds.cache_tokens
    results.append(row)
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="random:llama-3.1-8b")
    p.add_argument("--draft", default="random:llama-68m")
    p.add_argument("--lengths", default="4096,8192,16384,32768")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--tree-nodes", type=int, default=50)
    p.add_argument("--tree-depth", type=int, default=10)
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--retrieval-top-k", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--eager-max", type=int, default=8192)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--cuda-graphs", default="both",
                   help="comma-separated: decode-time forwards through the piecewise CUDA graphs (on), op by op "
                        "(off), the graphs with Inductor-compiled segments (compiled), one graph per forward with the Triton "
                        "prefix kernel (full, full-compiled, full-fused, full-fused-1: one launch); both = off,on; all = the seven")
    a = p.parse_args()
    target = load_model(a.target, "target", a.dtype, a.device, "auto")
    draft = load_model(a.draft, "draft", a.dtype, a.device, "auto", vocab_size=target.args.vocab_size,
                       target_weights=target.decoder.w)
    dev = target.decoder.device
    bw = copy_bandwidth(dev)
    results = []
    saved: dict = {}
    every = ["off", "on", "compiled", "full", "full-compiled", "full-fused", "full-fused-1"]
    graph_modes = {"both": ["off", "on"], "all": every}.get(a.cuda_graphs, a.cuda_graphs.split(","))
    if not set(graph_modes) <= set(every):
        p.error(f"--cuda-graphs: unknown mode in {a.cuda_graphs!r}")
    for L in [int(x) for x in a.lengths.split(",")]:
        for gi, g in enumerate(graph_modes):
            set_graphs([target, draft], g, saved)
            t0 = time.perf_counter()
            bench_length(target, draft, L, a, dev, bw, results, graphs=g, prefill=gi == 0)
            r = results[-1]
            r["bench_s"] = time.perf_counter() - t0
            print(f"L={L} graphs={g}: prefill {r['prefill_s']*1e3:.0f} ms, ar {r['ar_step_s']*1e3:.2f} ms "
                  f"(floor {r['floor_s']*1e3:.2f}), verify hta {r['verify_hta_s']*1e3:.2f} / plain "
                  f"{r['verify_plain_s']*1e3:.2f} ms (floor {r['verify_floor_s']*1e3:.2f}), draft full "
                  f"{r['draft_step_full_s']*1e3:.2f} / cmr {r['draft_step_cmr_s']*1e3:.2f} ms", flush=True)
    print("\n| L | graphs | prefill s | prefill eager s | AR step ms | floor ms | verify HTA ms (launch) | "
          "verify plain ms | HTA/floor | draft full ms | draft CMR ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        eager = f"{r['prefill_eager_s']:.3f}" if "prefill_eager_s" in r else "-"
        print(f"| {r['length']} | {r['graphs']} | {r['prefill_s']:.3f} | {eager} | "
              f"{r['ar_step_s']*1e3:.2f} | {r['floor_s']*1e3:.2f} | {r['verify_hta_s']*1e3:.2f} "
              f"({r['verify_hta_host_s']*1e3:.2f}) | {r['verify_plain_s']*1e3:.2f} | "
              f"{r['verify_hta_s']/r['verify_floor_s']:.2f} | {r['draft_step_full_s']*1e3:.2f} | "
              f"{r['draft_step_cmr_s']*1e3:.2f} |")
    meta = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
                target=a.target, draft=a.draft, dtype=str(target.decoder.dtype), copy_bandwidth_Bps=bw,
                tree=[a.tree_nodes, a.tree_depth, a.tree_topk], date=time.strftime("%Y-%m-%d"),
                graphs_captured=[m.decoder.graphs.num_graphs for m in (target, draft) if m.decoder.graphs])
    print(json.dumps(dict(meta=meta, results=results)))


if __name__ == "__main__":
    main()
