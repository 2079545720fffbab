"""Where a lookup run's step goes on the device (docs/architecture.md, "Lookup runs ahead"): CUDA-event
times of its parts against plain decoding's step, the target's production plan at a prompt length,
random weights of the geometry (the real pair's by default: times depend on shapes, not values).

  python benchmarks/lookup_ahead_parts.py --target random:qwen2.5-1.5b --length 16384
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from specextend.attention.backends import CAUSAL
from specextend.bench import record
from specextend.builder import load_pair
from specextend.config import EngineConfig
from specextend.lookup_ahead import DeviceHistory
from specextend.models.batch import forward_at
from specextend.target import TargetSession

OUT = Path(__file__).parent / "results" / "lookup_ahead"


def timed(fn, reps: int) -> float:
    """Microseconds a call of fn takes on the device, queued back to back (after two warm-up calls)."""
    for _ in range(2):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return 1e3 * a.elapsed_time(b) / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="random:qwen2.5-1.5b")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--q", type=int, default=8)
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args(argv)
    cfg = EngineConfig(target=a.target, mode="ar", device="cuda", dtype="bfloat16")
    target, _ = load_pair(cfg, roles=("target",))
    dec = target.decoder
    sess = TargetSession(dec, a.length + 256, hybrid=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (a.length,), generator=g).tolist()  # a small vocabulary: chains are found
    sess.prefill(prompt, cfg.prefill_chunk)
    L = sess.cache.length
    hists = {}
    for fast in (True, False):
        h = hists[fast] = DeviceHistory(sess.cache.capacity, a.q, dec.device, fast=fast)
        h.hist[:L + 1].copy_(torch.tensor(prompt + [prompt[-1]], device=dec.device))
        h.length.fill_(L + 1)
    one = torch.tensor([prompt[-1]], device=dec.device)
    path = torch.tensor([prompt[-1]] + prompt[:a.q], device=dec.device)
    start = torch.tensor([L], device=dec.device)

    def ar_step():
        sess.cache.length = L
        dec.forward(one, start, sess.cache, CAUSAL)

    def path_step():
        sess.cache.length = L
        dec.forward(path, start + torch.arange(a.q + 1, device=dec.device), sess.cache, CAUSAL)

    path5 = path[:5]

    def path5_step():
        sess.cache.length = L
        dec.forward(path5, start + torch.arange(5, device=dec.device), sess.cache, CAUSAL)

    def at_step():
        forward_at(dec, path, start, sess.cache)

    logits = forward_at(dec, path, start, sess.cache).clone()
    parts = dict(ar_step=ar_step, path_step=path_step, path5_step=path5_step, forward_at=at_step)
    for fast, hist in hists.items():
        name = "" if fast else "_twin"

        def match(hist=hist):
            hist.match()

        def verdict(hist=hist):
            hist.verdict(logits)
            hist.length.fill_(L + 1)

        def run_step(hist=hist):  # the whole step as a run queues it (the same work each time)
            co = hist.step_co(sess)
            call = next(co)
            try:
                co.send(call.run(dec))
            except StopIteration:
                pass
            hist.length.fill_(L + 1)

        parts.update({"match" + name: match, "verdict" + name: verdict, "run_step" + name: run_step})
    us = {k: round(timed(f, a.reps), 1) for k, f in parts.items()}
    for k, v in us.items():
        print(f"{k:14s} {v:8.1f} us")
    meta = dict(commit=record.commit(), device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                command="python benchmarks/lookup_ahead_parts.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    OUT.mkdir(parents=True, exist_ok=True)
    path_out = OUT / f"parts-{record.slug(record.device_name('cuda'))}-{a.length}.json"
    path_out.write_text(json.dumps(dict(meta=meta, us=us, length=a.length, q=a.q), indent=1) + "\n")
    print(f"wrote {path_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
