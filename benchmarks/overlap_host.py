"""Where the draft thread's time goes in overlapped drafting: one draft session on one device, its
background forwards driven the way the worker drives them (launch, poll, finish), with a ready step
every `--every` forwards (the pool's best forwarded path accepted, so every step is a hit).

  python benchmarks/overlap_host.py --draft random:qwen2.5-0.5b --length 16384

Prints per background forward the host time of `launch` (and of the model's forward inside it),
the wait for the device, the host time of `finish`, and per ready step the host time of `step`;
and with `--profile` the top host functions (cProfile, by own time, and specextend's by cumulative
time; the profiler slows the host, so the times it prints are not the plain run's). The JSON of the medians goes on the last line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.session import DraftSession
from specextend.models.loader import load_model


TIMES = ("launch_ms", "model_forward_host_ms", "device_wait_ms", "finish_ms", "ready_step_ms", "miss_step_ms")


def hit_path(pool) -> list[int]:
    """Tokens of the best forwarded path from the root, two deep (accepted token + bonus), or []."""
    path, parent = [], -1
    for _ in range(2):
        kids = [i for i in pool.children(parent) if pool.slots[i] >= 0]
        if not kids:
            return []
        parent = max(kids, key=lambda i: pool.scores[i])
        path.append(pool.tokens[parent])
    return path


def drive(s: DraftSession, forwards: int, every: int, times: dict) -> None:
    sync = torch.cuda.synchronize if s.model.device.type == "cuda" else (lambda: None)
    step, n = 1, 0
    while n < forwards:
        t0 = time.perf_counter()
        model_s = [0.0]
        fwd = s.model.forward

        def timed_forward(*a, **k):
            t = time.perf_counter()
            out = fwd(*a, **k)
            model_s[0] += time.perf_counter() - t
            return out
        s.model.forward = timed_forward
        more = s.launch()
        s.model.forward = fwd
        t1 = time.perf_counter()
        while not s.flight_done():
            pass
        t2 = time.perf_counter()
        s.finish()
        t3 = time.perf_counter()
        n += 1
        if more:
            times["launch_ms"].append((t1 - t0) * 1e3)
            times["model_forward_host_ms"].append(model_s[0] * 1e3)
            times["device_wait_ms"].append((t2 - t1) * 1e3)
            times["finish_ms"].append((t3 - t2) * 1e3)
        if n % every == 0 or not more:
            path = hit_path(s.pool) if s.pool is not None else []
            t4 = time.perf_counter()
            tree = s.step(step, path or [7], None)
            t5 = time.perf_counter()
            sync()
            times["ready_step_ms" if tree.ready else "miss_step_ms"].append((t5 - t4) * 1e3)
            step += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="random:qwen2.5-0.5b")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--forwards", type=int, default=300)
    ap.add_argument("--every", type=int, default=2, help="background forwards between ready steps")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--levels", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--profile", action="store_true", help="run the measured forwards under cProfile")
    ap.add_argument("--eager", action="store_true",
                    help="the bookkeeping between forwards as eager ops (no models/graphed.Graphed)")
    a = ap.parse_args()
    if a.eager:
        DraftSession._graphed = lambda self, fn: fn
    draft = load_model(a.draft, "draft")
    prompt = torch.randint(0, 256, (a.length,), generator=torch.Generator().manual_seed(0)).tolist()
    params = DraftSessionParams(TreeConfig(16, 6, 4), RetrievalConfig(enabled=True, draft_prefill_window=512),
                                max_new_tokens=4096)
    warm = DraftSession(draft.decoder, prompt[:4096], params, overlap=True, overlap_rows=a.rows,
                        overlap_levels=a.levels)
    warm.step(0, [7], None)
    warm.warm_up()
    s = DraftSession(draft.decoder, prompt, params, overlap=True, overlap_rows=a.rows, overlap_levels=a.levels)
    s.step(0, [7], None)
    drive(s, 50, a.every, {k: [] for k in TIMES})  # past the first captures
    times = {k: [] for k in TIMES}
    prof = cProfile.Profile()
    if a.profile:
        prof.enable()
    drive(s, a.forwards, a.every, times)
    prof.disable()
    med = {k: round(statistics.median(v), 4) if v else None for k, v in times.items()}
    counts = {k: len(v) for k, v in times.items()}
    for k in med:
        print(f"{k:24s} median {med[k]} ms  (n={counts[k]})")
    if a.profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
        pstats.Stats(prof).sort_stats("cumulative").print_stats("specextend", a.top)
    dev = torch.cuda.get_device_name() if draft.decoder.device.type == "cuda" else "cpu"
    print(json.dumps(dict(device=dev, draft=a.draft, length=a.length, rows=a.rows, levels=a.levels, eager=a.eager,
                          every=a.every, medians=med, counts=counts)))


if __name__ == "__main__":
    main()
