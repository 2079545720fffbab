"""The first long request after a replica's warm-up: what it meets that the warm-up did not (graph
plans captured, Triton kernels compiled or loaded: specextend/models/late_work.py), and its decode
speed against the next request's on another prompt of the same length.

In process, both models on one device, warmed as a served replica warms itself (warmup.warm_up,
then warmup.warm_long). The prompt is random ids with its first quarter repeated, so that context
lookup finds chains. Prints each late item and a table, writes JSON (commit, device, date, command).

    python benchmarks/first_request.py --target random:qwen2.5-1.5b --draft random:qwen2.5-0.5b --length 16384
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from specextend.bench.record import write_rows
from specextend.builder import build_engine
from specextend.config import EngineConfig, SamplingParams
from specextend.models import late_work
from specextend.warmup import warm_long, warm_up


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.items: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.items.append(record.getMessage())


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    """Random ids whose first quarter repeats (context lookup's chains)."""
    g = torch.Generator().manual_seed(seed)
    quarter = torch.randint(100, vocab - 100, (max(1, length // 4),), generator=g).tolist()
    return (quarter * 4)[:length]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="random:qwen2.5-1.5b")
    p.add_argument("--draft", default="random:qwen2.5-0.5b")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tree-policy", default="adaptive", choices=("adaptive", "fixed"))
    p.add_argument("--lookup-tokens", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/first_request"))
    a = p.parse_args(argv)
    cfg = EngineConfig(target=a.target, draft=a.draft, device=a.device, tree_policy=a.tree_policy,
                       lookup_tokens=a.lookup_tokens, max_prompt_tokens=a.length + 64)
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    vocab = engine.target.args.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(12)]  # a short warm-up prompt, as the replica's
    warm_up(engine, ids * 8)
    warm_long(engine, ids)
    print(f"built and warmed in {time.perf_counter() - t0:.1f} s; late from here on", flush=True)
    collect = _Collect()
    logging.getLogger(late_work.__name__).addHandler(collect)
    late_work.mark_ready()
    rows = []
    for i in range(2):
        before, n0 = late_work.counts(), len(collect.items)
        ids_i = prompt(a.length, vocab, seed=i)
        t = time.perf_counter()
        _, _, st = engine.generate(ids_i, SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True))
        wall = time.perf_counter() - t
        after = late_work.counts()
        rows.append(dict(request=i, tokens=st.num_generated, wall_s=wall, prefill_s=st.prefill_s,
                         decode_tokens_per_s=(st.num_generated - 1) / max(st.decode_s, 1e-9),
                         late={k: after[k] - before[k] for k in after}, items=collect.items[n0:],
                         steps=st.num_steps, plain_steps=st.plain_steps, lookup_steps=st.lookup_steps))
        print(f"request {i}: {rows[-1]['decode_tokens_per_s']:.1f} decode tok/s, {wall:.2f} s, late {rows[-1]['late']}",
              flush=True)
        for item in rows[-1]["items"]:
            print("   ", item)
    print("| request | decode tok/s | wall s | late captures | late kernels |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['request']} | {r['decode_tokens_per_s']:.1f} | {r['wall_s']:.2f} | {r['late']['capture']} | "
              f"{r['late']['kernel']} |")
    path = write_rows(a.out, "", "first_request", a, rows, sys.argv[1:])
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
