"""Time to first token of prompts whose lengths no earlier request had (chat-sized prompts: each
a new shape for every prefill kernel), with PyTorch's cuDNN attention off (the product's setting,
attention/backends.no_cudnn_attention) and back on, alternating, on one engine warmed as a replica
warms itself. Prints each request's time and the medians; writes JSON under results/open/.

    python benchmarks/ttft_lengths.py --target random:qwen2.5-1.5b --mode ar --requests 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specextend.bench.record import write_rows
from specextend.builder import build_engine
from specextend.config import EngineConfig, SamplingParams
from specextend.warmup import warm_long, warm_up


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="random:qwen2.5-1.5b")
    p.add_argument("--draft", default="random:qwen2.5-0.5b")
    p.add_argument("--mode", default="ar")
    p.add_argument("--requests", type=int, default=12, help="requests per arm")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1900)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/open"))
    a = p.parse_args(argv)
    cfg = EngineConfig(target=a.target, draft=a.draft, mode=a.mode, device=a.device, prefix_cache_gb=0,
                       max_prompt_tokens=max(a.max_len, 4096) + 64)
    engine = build_engine(cfg)
    vocab = engine.target.args.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(12)]
    warm_up(engine, ids * 8)
    if cfg.uses_draft:
        warm_long(engine, ids)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(a.min_len, a.max_len, (2 * a.requests,), generator=g).tolist()
    rows = []
    for n, length in enumerate(lengths):
        cudnn = n % 2 == 1  # alternating arms, every length new
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        prompt = torch.randint(100, vocab - 100, (length,), generator=g).tolist()
        t = time.perf_counter()
        _, _, st = engine.generate(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
        rows.append(dict(cudnn=cudnn, length=length, ttft_ms=1e3 * st.prefill_s,
                         wall_ms=1e3 * (time.perf_counter() - t)))
        print(json.dumps(rows[-1]), flush=True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    for arm in (False, True):
        ms = [r["ttft_ms"] for r in rows if r["cudnn"] == arm]
        print(f"cuDNN {'on ' if arm else 'off'}: time to first token median {statistics.median(ms):.1f} ms, "
              f"max {max(ms):.1f} ms over {len(ms)} new lengths")
    path = write_rows(a.out, f"ttft-lengths-{a.mode}-", "ttft_lengths", a, rows, sys.argv[1:])
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
