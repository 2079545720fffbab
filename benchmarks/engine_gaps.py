"""Where a whole request's decode steps leave the device idle, per engine mode, in one process.

  python benchmarks/engine_gaps.py --pair real --length 16384 --modes ar,lookup,specextend --tokens 48

Runs each mode's engine (bench/e2e.py's engines: graphs, warm-up) on one prompt, then profiles one
more request with torch.profiler (CPU and CUDA activity, Python stacks). The device's busy time is the
union of its kernels and copies after the first decode step's first kernel; every idle gap of 5 us or
more is charged, inclusively, to each Python function of the engine's thread that was running during
it (a function and its callers all get the gap). Prints per mode: wall and device busy time per token,
the idle time per token, and the functions that held the host longest while the device waited.
Companion of trace_gaps.py (one step's timeline); this one answers "what host work does a mode add
to a step" (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from trace_gaps import DEVICE_CATS, sweep  # this folder (on the path when run as a script)

from specextend.bench import e2e
from specextend.bench.texts import documents, prompt_ids
from specextend.config import SamplingParams


def on_target(e: dict) -> bool:
    """A kernel, copy or memset on the target's device (cuda:0; a -2gpu mode's draft is on cuda:1)."""
    return e.get("ph") == "X" and e.get("cat") in DEVICE_CATS and e.get("args", {}).get("device", 0) == 0


def idle_gaps(events: list[dict], t_from: float, min_gap_us: float = 5.0) -> tuple[float, float, list[tuple[float, float]]]:
    """-> (device span us, busy us, [(gap start, gap end)]) over device events starting at t_from."""
    dev = sorted((e for e in events if on_target(e) and e["ts"] >= t_from), key=lambda e: e["ts"])
    span, busy, idle = sweep(dev, min_gap_us)
    return span, busy, [(start, e["ts"]) for start, e in idle]


def thread_of(events: list[dict], marker: tuple[str, str] = ("engine.py", "_session")) -> set:
    """The 'Python id's of the call tree that holds the engine's session coroutine: the events under
    the same root frame as the first one whose name has both `marker` strings. The profiler may give
    every Python thread's events one chrome 'tid' (seen on a GPU host, 2026-11-27: the draft worker's
    and thread pools' waits were charged as the engine's), so threads are told apart by their call
    trees ('Python parent id'), not by tid."""
    py = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
    parent = {e["args"]["Python id"]: e["args"].get("Python parent id") for e in py if "Python id" in e.get("args", {})}

    def root(i):
        while parent.get(i) is not None:
            i = parent[i]
        return i

    mark = next((e for e in py if all(m in e["name"] for m in marker) and "Python id" in e.get("args", {})), None)
    if mark is None:
        return set()
    top = root(mark["args"]["Python id"])
    return {i for i in parent if root(i) == top}


def charges(events: list[dict], gaps: list[tuple[float, float]], ids: set) -> tuple[dict[str, float], dict[str, float]]:
    """Idle us per Python function of the call tree `ids` (thread_of), from its frames overlapping
    each gap, in one pass: (inclusive: a caller gets its callees' idle; exclusive: each frame's own
    part, its overlap less its children's, where the host actually was)."""
    starts = [a for a, _ in gaps]
    seen_by: dict[int, float] = {}
    names: dict[int, str] = {}
    parent: dict[int, object] = {}
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "X" or e.get("cat") != "python_function" or args.get("Python id") not in ids:
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        seen = 0.0
        while i < len(gaps) and gaps[i][0] < b:
            lo, hi = max(a, gaps[i][0]), min(b, gaps[i][1])
            seen += max(0.0, hi - lo)
            i += 1
        pid = args["Python id"]
        seen_by[pid], names[pid], parent[pid] = seen, e["name"], args.get("Python parent id")
    own = dict(seen_by)
    for pid, seen in seen_by.items():
        if parent[pid] in own:
            own[parent[pid]] -= seen

    def by_name(per_frame: dict[int, float]) -> dict[str, float]:
        by: dict[str, float] = defaultdict(float)
        for pid, seen in per_frame.items():
            if seen > 0:
                by[names[pid]] += seen
        return by

    return by_name(seen_by), by_name(own)


def charge(events: list[dict], gaps: list[tuple[float, float]], ids: set,
           exclusive: bool = False) -> dict[str, float]:
    """One of `charges`: inclusive, or with `exclusive` each frame's own part."""
    return charges(events, gaps, ids)[1 if exclusive else 0]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_request(engine, prompt, tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as p:
        t0 = time.perf_counter()
        n, st = 0, None
        for ev in engine.stream(prompt, params):
            n += len(ev.token_ids)
            st = ev.stats
        sync()
        t_end = time.perf_counter()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    p.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    return dict(events=events, decode_s=st.decode_s, tokens=n, wall_s=t_end - t0, stats=st)


def profile_open(engines: dict, prompt: list[int], top: int) -> dict:
    """One draft open of `prompt` (the first engine with a draft), timed and profiled alone: its wall
    time against the target's prefill of the same prompt, and its kernels by device time."""
    from specextend.draft.base import DraftSessionParams
    from specextend.target import TargetSession

    eng = next(e for e in engines.values() if e.draft is not None)
    cfg = eng.config
    params = DraftSessionParams(cfg.tree, cfg.retrieval, 128, cfg.lookup_tokens)
    target = TargetSession(eng.target.decoder, len(prompt) + 8, hybrid=cfg.hybrid_attention)
    sync()
    t0 = time.perf_counter()
    target.prefill(prompt, cfg.prefill_chunk)
    sync()
    prefill_s = time.perf_counter() - t0
    eng.draft.open("gaps-warm", prompt, params)  # first use of this length's shapes
    eng.draft.close("gaps-warm")
    sync()
    t0 = time.perf_counter()
    eng.draft.open("gaps-timed", prompt, params)
    sync()
    open_s = time.perf_counter() - t0
    eng.draft.close("gaps-timed")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        eng.draft.open("gaps-prof", prompt, params)
        sync()
    eng.draft.close("gaps-prof")
    kern: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern[e.name][0] += getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0)
            kern[e.name][1] += 1
    rows = sorted(((k, us / 1e3, c) for k, (us, c) in kern.items()), key=lambda x: -x[1])[:top]
    print(f"\n== draft open of {len(prompt)} tokens: {1e3 * open_s:.1f} ms (target prefill {1e3 * prefill_s:.1f} ms); "
          f"device {sum(us for us, _ in kern.values()) / 1e3:.1f} ms of kernels")
    for name, ms, c in rows:
        print(f"  {ms:8.2f} ms {c:5d}x  {name[:140]}")
    return dict(mode="draft-open", open_ms=1e3 * open_s, target_prefill_ms=1e3 * prefill_s, kernels=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="real")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--doc", default="nodejs")
    ap.add_argument("--modes", default="ar,lookup,specextend")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--tree-policy", default="adaptive")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace-dir", default="", help="also write each mode's trace here (gzipped)")
    ap.add_argument("--json", default="")
    ap.add_argument("--open", action="store_true",
                    help="also profile one draft open (its prefill) beside a target prefill of the prompt")
    a = ap.parse_args()
    modes = a.modes.split(",")
    target, engines, _, workers = e2e._engines(e2e.PAIRS[a.pair], modes, "auto", a.tree_policy, "auto")
    doc = documents([a.doc])[0]
    prompt = prompt_ids(target.tokenizer, doc, a.length)
    warm: set = set()
    results = []
    try:
        for mode in modes:
            eng = engines[mode]
            e2e.run_engine(eng, prompt, a.tokens, None, warm)  # warm-up and one untimed request
            _, r = e2e.run_engine(eng, prompt, a.tokens, None, warm)
            res = profile_request(eng, prompt, a.tokens)
            ev = res["events"]
            st = res["stats"]
            # the decode steps: device events after the prefill's last kernel, approximated as the
            # last 'decode_s' of the trace's device span
            dev_end = max((e["ts"] + e["dur"] for e in ev if on_target(e)), default=0.0)
            t_from = dev_end - st.decode_s * 1e6
            span, busy, gaps = idle_gaps(ev, t_from)
            # the engine's thread: the one running its session coroutine
            ids = thread_of(ev)
            by, own = charges(ev, gaps, ids)
            ntok = max(res["tokens"] - 1, 1)
            kern: dict[str, list] = defaultdict(lambda: [0.0, 0])  # the decode steps' kernels by name
            for e in ev:
                if on_target(e) and e["ts"] >= t_from:
                    kern[e["name"]][0] += e["dur"]
                    kern[e["name"]][1] += 1
            idle = sum(b - a for a, b in gaps)
            row = dict(mode=mode, decode_tok_s=ntok / st.decode_s, unprofiled_decode_tok_s=r["decode_tokens_per_s"],
                       wall_ms_per_token=1e3 * st.decode_s / ntok, busy_ms_per_token=busy / 1e3 / ntok,
                       idle_ms_per_token=idle / 1e3 / ntok, gaps_per_token=len(gaps) / ntok,
                       steps=st.num_steps, plain_steps=st.plain_steps, lookup_steps=st.lookup_steps,
                       unready_steps=st.unready_steps,
                       top=sorted(((k, v / 1e3 / ntok) for k, v in by.items()), key=lambda kv: -kv[1])[:a.top],
                       self_top=sorted(((k, v / 1e3 / ntok) for k, v in own.items()), key=lambda kv: -kv[1])[:a.top],
                       kernels=sorted(((k, us / ntok, c / ntok) for k, (us, c) in kern.items()),
                                      key=lambda x: -x[1])[:a.top])
            results.append(row)
            print(f"\n== {mode}: {row['unprofiled_decode_tok_s']:.1f} tok/s unprofiled, profiled "
                  f"{row['wall_ms_per_token']:.3f} ms/token wall, device busy {row['busy_ms_per_token']:.3f}, idle "
                  f"{row['idle_ms_per_token']:.3f} in {row['gaps_per_token']:.1f} gaps; steps {st.num_steps} tree, "
                  f"{st.plain_steps} plain, {st.lookup_steps} lookup, {st.unready_steps} unready"
                  + e2e.kinds_line(r), flush=True)
            for name, ms in row["top"]:
                print(f"  {ms * 1e3:8.1f} us/token idle  {name[:150]}")
            print("  own time (the frame itself, not its callees) during the idle gaps:")
            for name, ms in row["self_top"]:
                print(f"  {ms * 1e3:8.1f} us/token self  {name[:150]}")
            print("  kernels (device us per token, launches per token):")
            for name, us, c in row["kernels"]:
                print(f"  {us:8.1f} us/token {c:6.1f}x  {name[:140]}")
            if a.trace_dir:
                os.makedirs(a.trace_dir, exist_ok=True)
                with gzip.open(os.path.join(a.trace_dir, f"{mode}.json.gz"), "wt") as f:
                    json.dump({"traceEvents": [e for e in ev if e.get("cat") != "python_function"]}, f)
        if a.open:
            results.append(profile_open(engines, prompt, a.top))
    finally:
        for w in workers:
            w.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(pair=a.pair, length=a.length, doc=a.doc, tokens=a.tokens, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
