"""Where the device idles inside a profiled step, and what the host was doing meanwhile.

  python benchmarks/trace_gaps.py TRACE.json.gz [--steps N] [--top 12]

Reads a chrome trace written by `profile_step.py --trace` (torch.profiler, CUDA activity on):
the union of kernel and copy intervals is the device's busy time; every gap between them longer
than 5 us is idle time, charged to the host op that launched the kernel ending the gap (the
innermost CPU op around that launch). Prints busy/idle per step and the largest idle causes.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def sweep(dev: list[dict], min_gap_us: float = 5.0) -> tuple[float, float, list[tuple[float, dict]]]:
    """Device events sorted by start -> (span us, busy us: the union of their intervals, and each idle
    gap of at least `min_gap_us` as (its start, the event that ends it))."""
    if not dev:
        return 0.0, 0.0, []
    busy, out, end = 0.0, [], dev[0]["ts"]
    for e in dev:
        if e["ts"] > end:
            if e["ts"] - end >= min_gap_us:
                out.append((end, e))
            busy += e["dur"]
            end = e["ts"] + e["dur"]
        elif e["ts"] + e["dur"] > end:
            busy += e["ts"] + e["dur"] - end
            end = e["ts"] + e["dur"]
    return end - dev[0]["ts"], busy, out


def gaps(events: list[dict], min_gap_us: float = 5.0):
    """-> (device span us, busy us, [(gap us, host op that launched the next kernel)])."""
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "args" in e}
    cpu_ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function")),
                     key=lambda e: e["ts"])
    if not dev:
        return 0.0, 0.0, []

    def innermost(ts: float) -> str:
        best = None
        for op in cpu_ops:  # small traces: a linear scan is fine
            if op["ts"] > ts:
                break
            if op["ts"] + op["dur"] >= ts and (best is None or op["dur"] <= best["dur"]):
                best = op
        return best["name"] if best else "?"

    span, busy, idle = sweep(dev, min_gap_us)
    out = []
    for start, e in idle:
        launch = launches.get(e.get("args", {}).get("correlation"))
        out.append((e["ts"] - start, innermost(launch["ts"]) if launch else "?"))
    return span, busy, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1, help="steps in the trace (per-step figures)")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    span, busy, idle = gaps(load(a.trace))
    by = defaultdict(lambda: [0.0, 0])
    for us, name in idle:
        by[name][0] += us
        by[name][1] += 1
    n = a.steps
    print(f"{a.trace}: device span {span / n / 1e3:.2f} ms, busy {busy / n / 1e3:.2f} ms, "
          f"idle {(span - busy) / n / 1e3:.2f} ms per step ({len(idle) / n:.0f} gaps >= 5 us)")
    for name, (us, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"  {us / n:8.1f} us idle per step in {c / n:5.1f} gaps before kernels launched from {name}")
    print(json.dumps(dict(trace=a.trace, span_ms=span / n / 1e3, busy_ms=busy / n / 1e3,
                          idle_ms=(span - busy) / n / 1e3)))


if __name__ == "__main__":
    main()
