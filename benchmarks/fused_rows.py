"""Device time of the fused decode-time layers at each row count, for an A/B of two checkouts.

Run it once per checkout on the same machine (each with its own `TRITON_CACHE_DIR`), alternating,
twice: a difference under the spread between a checkout's two rounds is noise.

    cd OLD && PYTHONPATH=$PWD python NEW/benchmarks/fused_rows.py old1
    cd NEW && PYTHONPATH=$PWD python benchmarks/fused_rows.py new1

One JSON line per (model, keys, rows): the layers' CUDA-graph replay time (us; the head not
included) and the first forward's wall time (s; the kernels it compiled or loaded included). The
target's geometry at 16K committed keys and verify sizes, then the draft's at a retrieval cache of 1K.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from specextend.attention.backends import CAUSAL
from specextend.bench.kernels import graph_us
from specextend.models.decoder import ForwardOptions
from specextend.models.full_graphs import FullStepGraphs
from specextend.models.loader import load_model

SHAPES = (("random:qwen2.5-1.5b", 16384, (1, 4, 8, 16, 24, 32, 50)),
          ("random:qwen2.5-0.5b", 1024, (1, 4, 8, 16)))


def main(tag: str) -> None:
    for model, keys, row_counts in SHAPES:
        dec = load_model(model, "draft", dtype="bfloat16", device="cuda", execution="eager").decoder
        cache = dec.new_cache(keys + 128)
        cache.data.normal_()
        cache.advance(keys)
        n = dec.args.num_layers
        for rows in row_counts:
            ids = torch.randint(0, dec.args.vocab_size, (rows,), device="cuda")  # [rows]
            pos = torch.arange(keys, keys + rows, device="cuda")  # [rows]
            t0 = time.perf_counter()
            gr = FullStepGraphs(dec, capture=False, fused=True, persistent=False)
            gr.forward(ids, pos, cache, CAUSAL, ForwardOptions())
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            plan = next(iter(gr.plans.values()))
            us = graph_us(lambda: gr._body(plan, range(n)), 50)
            print(json.dumps(dict(tag=tag, model=model, keys=keys, rows=rows, us=round(us, 1),
                                  first_s=round(first, 2))), flush=True)
        del dec, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
