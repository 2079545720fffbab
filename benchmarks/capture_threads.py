"""Two threads capturing CUDA graphs at once, with and without the process's capture lock
(specextend/models/capture.py; docs/architecture.md, "Overlapped drafting", captures one at a
time). Prints how many of each thread's captures succeeded and the errors met.

    python benchmarks/capture_threads.py [--captures 60]

On an H100 (torch 2.13, 2026-11-28): without the lock 3-7 of 60 a thread, then "operation not
permitted when stream is capturing"; with it 60 and 60."""

from __future__ import annotations

import argparse
import threading

import torch

from specextend.models.capture import capture


def capturer(locked: bool, n: int, w: torch.Tensor, out: list) -> None:
    dev = w.device
    s, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    x = torch.linspace(-1, 1, 8 * w.shape[0], device=dev).view(8, w.shape[0])
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture
        torch.nn.functional.silu(x @ w)
    s.synchronize()
    keep, ok, errors = [], 0, set()
    for _ in range(n):
        g = torch.cuda.CUDAGraph()
        try:
            ctx = capture(g, s, pool) if locked else torch.cuda.graph(g, pool=pool, stream=s,
                                                                       capture_error_mode="thread_local")
            with ctx:
                y = x
                for _ in range(8):
                    y = torch.nn.functional.silu(y @ w)
            keep.append((g, y))
            g.replay()
            ok += 1
        except Exception as e:  # noqa: BLE001 - counted and printed
            errors.add(str(e).splitlines()[0][:120])
    out.append((ok, sorted(errors)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captures", type=int, default=60)
    args = ap.parse_args()
    w = torch.linspace(-1, 1, 1024 * 1024, device="cuda").view(1024, 1024) / 32
    for locked in (True, False):  # (a failed capture can leave the allocator unusable: unlocked last)
        out: list = []
        threads = [threading.Thread(target=capturer, args=(locked, args.captures, w, out)) for _ in range(2)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        print(f"{'with' if locked else 'without'} the lock: captures that succeeded "
              f"{[ok for ok, _ in out]} of {args.captures} a thread; errors {sorted({e for _, es in out for e in es})}")


if __name__ == "__main__":
    main()
