"""Where one decode-time step spends host and device time (torch.profiler), graphs on.

  python benchmarks/profile_step.py --length 16384 --draft random:llama-3.2-1b

Prints, per step kind, the wall time, the summed device-kernel time and the top host ops; the JSON
of the totals goes on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.session import DraftSession
from specextend.models.loader import load_model
from specextend.target import TargetSession

from specextend.bench.kernels import dense_tree as fixed_tree


TRACE = {}  # --trace: the folder where each step kind's chrome trace goes (gzipped)


def prof(name, fn, reps, out, rows=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(TRACE.get("dir"))) as p:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps
    if TRACE.get("dir"):  # the timeline: where the device waits for the host, and on what
        import gzip
        import os
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            tmp = f.name
        p.export_chrome_trace(tmp)
        with open(tmp, "rb") as src, gzip.open(os.path.join(TRACE["dir"], f"{name}.json.gz"), "wb") as dst:
            dst.write(src.read())
        os.unlink(tmp)
    ev = p.key_averages()
    dev_us = sum(e.self_device_time_total for e in ev) / reps
    kernels = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / reps
    print(f"\n=== {name}: wall {wall*1e3:.2f} ms, device kernels {dev_us/1e3:.2f} ms per step, "
          f"{kernels:.0f} device ops per step")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(ev.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=90))
    out[name] = dict(wall_ms=wall * 1e3, device_ms=dev_us / 1e3, device_ops=kernels)


def unprofiled(name, fn, reps, out):
    """Without the profiler: the median wall time of `reps` steps (none: nothing)."""
    if not reps:
        return
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    out[name]["wall_ms_unprofiled"] = statistics.median(times)
    print(f"{name}: {statistics.median(times):.2f} ms median wall without the profiler ({reps} steps)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="random:llama-3.1-8b")
    ap.add_argument("--draft", default="random:llama-3.2-1b")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--rows", type=int, default=10, help="rows of the device-time table")
    ap.add_argument("--only-verify", action="store_true")
    ap.add_argument("--execution", default="auto", choices=("auto", "graphs", "eager"))
    ap.add_argument("--skinny", default="auto", choices=("auto", "on", "off"),
                    help="the skinny linear kernels in the full-step graphs (auto: the loader's choice)")
    ap.add_argument("--persistent", default="auto", choices=("auto", "on", "off"),
                    help="a decoder layer per launch (models/persistent.py; auto: the loader's choice)")
    ap.add_argument("--trace", help="a folder: write each step kind's chrome trace there (.json.gz)")
    ap.add_argument("--accepted", type=int, default=1, help="tokens the draft step commits (1: the bonus only)")
    ap.add_argument("--wall-reps", type=int, default=0,
                    help="also time this many steps of each kind without the profiler")
    ap.add_argument("--fold", default="auto", choices=("auto", "on", "off"),
                    help="both models' norms folded into their products (fused_layer.fold_model_norms; "
                         "auto: the loader's)")
    ap.add_argument("--small-verify", type=int, default=0,
                    help="also time a verification of this many nodes in a chain (a lookup's size)")
    ap.add_argument("--max-splits", type=int, default=0,
                    help="the prefix kernel's most splits a (row block, KV head) "
                         "(triton_prefix.MAX_SPLITS; 0: as shipped)")
    ap.add_argument("--mid-block-n", type=int, default=0,
                    help="the prefix kernel's key block at 17-64 folded rows "
                         "(triton_prefix.MID_BLOCK_N; 0: as shipped)")
    ap.add_argument("--narrow-block-n", type=int, default=0,
                    help="... for head dims of 64 or less (triton_prefix.NARROW_BLOCK_N; 0: as shipped)")
    a = ap.parse_args()
    TRACE["dir"] = a.trace
    from specextend.attention import triton_prefix

    triton_prefix.MAX_SPLITS = a.max_splits or triton_prefix.MAX_SPLITS
    triton_prefix.MID_BLOCK_N = a.mid_block_n or triton_prefix.MID_BLOCK_N
    triton_prefix.NARROW_BLOCK_N = a.narrow_block_n or triton_prefix.NARROW_BLOCK_N
    if a.fold != "auto":
        from specextend.models import loader

        loader.FOLD_NORMS = a.fold == "on"
    kw = dict(execution=a.execution)
    target = load_model(a.target, "target", **kw)
    draft = load_model(a.draft, "draft", vocab_size=target.args.vocab_size, **kw)
    if a.skinny != "auto" or a.persistent != "auto":
        from specextend.models.full_graphs import FullStepGraphs
        from specextend.models.loader import persistent_kernels_supported, skinny_kernels_supported

        for m in (target, draft):
            d = m.decoder
            skinny = skinny_kernels_supported(d) if a.skinny == "auto" else a.skinny == "on"
            persist = persistent_kernels_supported(d) if a.persistent == "auto" else a.persistent == "on"
            d.graphs = FullStepGraphs(d, fused=True, skinny=skinny, persistent=persist)
    prompt = torch.randint(0, 256, (a.length,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    sess = TargetSession(target.decoder, a.length + 64, hybrid=True)
    sess.prefill(prompt, 4096)
    parents = fixed_tree(a.tree_nodes, 4)

    def verify():
        sess.verify(5, [11] * len(parents), parents, capture=False)
    prof(f"verify_hta_{len(parents) + 1}", verify, a.reps, out, a.rows)
    unprofiled(f"verify_hta_{len(parents) + 1}", verify, a.wall_reps, out)
    if a.small_verify:
        chain = list(range(-1, a.small_verify - 1))  # a lookup's chain of nodes

        def verify_small():
            sess.verify(5, [11] * len(chain), chain, capture=False)
        prof(f"verify_hta_{len(chain) + 1}", verify_small, a.reps, out, a.rows)
        unprofiled(f"verify_hta_{len(chain) + 1}", verify_small, a.wall_reps, out)
    if a.only_verify:
        print(json.dumps(dict(device=torch.cuda.get_device_name(), length=a.length, **out)))
        return

    def ar():
        sess.decode(7)
        sess.cache.truncate(a.length)
    prof("ar_decode", ar, a.reps, out)
    unprofiled("ar_decode", ar, a.wall_reps, out)
    params = DraftSessionParams(TreeConfig(16, 6, 4), RetrievalConfig(enabled=True, draft_prefill_window=512),
                                max_new_tokens=256)

    class LevelSession(DraftSession):  # a forward per level (no whole-expansion graph)
        def _tree_graphs(self, tree):
            return None

    for name, cls in (("draft_step_cmr", DraftSession), ("draft_step_cmr_levels", LevelSession)):
        ds = cls(draft.decoder, prompt, params)
        k = [0]

        def dstep(ds=ds, k=k):
            ds.step(k[0], [3] * a.accepted, None)
            k[0] += 1
        prof(name, dstep, a.reps, out)
        unprofiled(name, dstep, a.wall_reps, out)
    print(json.dumps(dict(device=torch.cuda.get_device_name(), length=a.length, draft=a.draft,
                          persistent=a.persistent, **out)))


if __name__ == "__main__":
    main()
