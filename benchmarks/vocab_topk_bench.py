"""draft/vocab_topk.py's kernels against torch (topk + log-sum-exp) on the draft's logits shapes,
each replayed as a CUDA graph of 20 calls (kernel time without launch overhead), median of 20.

  python benchmarks/vocab_topk_bench.py --vocab 151936 --rows 4,8,16 --w 4,8
"""

from __future__ import annotations

import argparse
import json

import torch

from specextend.draft.vocab_topk import vocab_topk

from prefix_kernel import bench  # CUDA-graph replays of 20 calls, median of the replays, microseconds a call


def torch_twin(logits, w):
    top = torch.topk(logits, w)
    return top.values.float() - torch.logsumexp(logits.float(), -1, keepdim=True), top.indices


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="4,8,16")
    ap.add_argument("--w", default="4,8")
    a = ap.parse_args()
    out = []
    for r in map(int, a.rows.split(",")):
        for w in map(int, a.w.split(",")):
            logits = torch.randn(r, a.vocab, device="cuda").to(torch.bfloat16)
            k = bench(lambda: vocab_topk(logits, w), reps=20)
            t = bench(lambda: torch_twin(logits, w), reps=20)
            out.append(dict(rows=r, w=w, kernels_us=round(k, 1), torch_us=round(t, 1)))
            print(f"rows {r:3d} w {w:2d}: kernels {k:6.1f} us, torch topk + lse {t:6.1f} us")
    print(json.dumps(dict(device=torch.cuda.get_device_name(), vocab=a.vocab, rows=out)))


if __name__ == "__main__":
    main()
