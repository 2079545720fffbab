"""fused_sample.py's kernels against sampling's PyTorch path (their twin) on a 152K vocabulary
(temperature, top-k, top-p), then end to end: `ar` on the 1.5B geometry (random weights) at 16K,
greedy and sampled, with the kernels and without (docs/architecture.md, "Kernels": *Fused
sampling*). Prints a table, writes results/kernels/fused_sample-<device>.json.

  python benchmarks/fused_sample_bench.py --rows 1,9,17 --length 16384 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specextend import fused_sample, sampling
from specextend.bench import record
from specextend.builder import load_pair
from specextend.config import EngineConfig, SamplingParams
from specextend.engine import Engine
from specextend.warmup import warm_up

from prefix_kernel import bench  # CUDA-graph replays of 20 calls, median of the replays, microseconds a call

OUT = Path(__file__).parent / "results" / "kernels"


def eager_us(fn, n: int = 50) -> float:
    """Device time of one call launched eagerly (CUDA events over n calls), microseconds."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n * 1e3


def twin(logits, params, u):
    return sampling.search(sampling.target_probs(logits, params), u)


def kernels(rows: list[int], vocab: int) -> list[dict]:
    out = []
    for dt in (torch.bfloat16, torch.float32):
        for top_k, top_p in ((0, 1.0), (50, 1.0), (0, 0.95)):
            params = SamplingParams(8, temperature=0.8, top_k=top_k, top_p=top_p)
            for r in rows:
                x = torch.randn(r, vocab, device="cuda", dtype=dt) * 4  # [R, V]
                u = torch.rand(r, device="cuda", dtype=torch.float64)  # [R]
                same = float((fused_sample.fused_sample(x, params, u) == twin(x.float(), params, u)).float().mean())
                row = dict(dtype=str(dt)[6:], top_k=top_k, top_p=top_p, rows=r,
                           torch_us=eager_us(lambda: twin(x, params, u)),
                           fused_us=eager_us(lambda: fused_sample.fused_sample(x, params, u)),
                           fused_graphed_us=bench(lambda: fused_sample.fused_sample(x, params, u), reps=10),
                           torch_graphed_us=bench(lambda: twin(x, params, u), reps=10), same=same)
                out.append(row)
                print(f"{row['dtype']:9s} top_k {top_k:2d} top_p {top_p:.2f} rows {r:2d}:"
                      f" torch {row['torch_us']:6.0f} us eager,"
                      f" {row['torch_graphed_us']:6.1f} graphed; fused {row['fused_us']:5.0f} eager,"
                      f" {row['fused_graphed_us']:5.1f} graphed; same samples {same:.2f}", flush=True)
    return out


def end_to_end(length: int, new_tokens: int, reps: int) -> dict:
    cfg = EngineConfig(target="random:qwen2.5-1.5b", draft="random:qwen2.5-0.5b", mode="ar", device="cuda",
                       dtype="bfloat16")
    target, _ = load_pair(cfg)
    engine = Engine(cfg, target, None)
    prompt = torch.randint(0, 150000, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    warm_up(engine, prompt[:64])

    def rate(params) -> float:
        t0, n = None, 0
        for ev in engine.stream(prompt, params):
            if ev.token_ids and t0 is None:
                t0 = time.perf_counter()
                continue
            n += len(ev.token_ids)
        return n / (time.perf_counter() - t0)

    kw = dict(max_new_tokens=new_tokens, ignore_eos=True)
    cases = (("greedy", SamplingParams(**kw), True),
             ("t0.8 fused", SamplingParams(temperature=0.8, seed=1, **kw), True),
             ("t0.8 torch", SamplingParams(temperature=0.8, seed=1, **kw), False),
             ("t0.8 top_p0.95 fused", SamplingParams(temperature=0.8, top_p=0.95, seed=1, **kw), True),
             ("t0.8 top_p0.95 torch", SamplingParams(temperature=0.8, top_p=0.95, seed=1, **kw), False))
    real, top_p_on, rates = fused_sample.supported, fused_sample.TOP_P_KERNELS, {name: [] for name, _, _ in cases}
    try:
        for _ in range(reps):  # interleaved
            for name, params, fused in cases:
                fused_sample.supported = real if fused else (lambda *a: False)
                fused_sample.TOP_P_KERNELS = fused  # (top-p through the kernels, on or off by default)
                rates[name].append(rate(params))
    finally:
        fused_sample.supported, fused_sample.TOP_P_KERNELS = real, top_p_on
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k, v in med.items():
        print(f"ar, 1.5B geometry, {length} tokens, {k:24s} {v:6.1f} tok/s ({1e3 / v:.2f} ms a token)")
    return dict(length=length, new_tokens=new_tokens, medians=med, runs=rates)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,9,17")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    meta = record.meta("fused_sample", "cuda", [])  # (not the kernels suite: --report reads those)
    meta["command"] = "python benchmarks/fused_sample_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = dict(meta=meta,
                  kernels=kernels([int(r) for r in a.rows.split(",")], a.vocab),
                  end_to_end=end_to_end(a.length, a.new_tokens, a.reps))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"fused_sample-{record.slug(result['meta']['device'])}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
