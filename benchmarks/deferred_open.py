"""The deferred draft open, on and off (docs/architecture.md, "Adaptive speculation", *Deferred
open*): `ar`, the adaptive engine, and the same with every session opening its draft at once,
interleaved, each request a prompt no cache has seen (a tag ahead of the document: the target's and
the draft's prefix caches miss, as with new traffic), per document. Prints each request's time to
first token, decode tokens/s and whether the draft was opened; writes results/deferred/.

    python benchmarks/deferred_open.py --device cuda --docs shakespeare,nodejs --length 16384 --reps 6
    python benchmarks/deferred_open.py --pair tiny --length 1024 --reps 3   # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from specextend.bench import e2e, record
from specextend.bench.texts import documents, prompt_ids
from specextend.builder import draft_worker, load_pair
from specextend.config import EngineConfig, SamplingParams
from specextend.engine import Engine
from specextend.warmup import warm_up

OUT = Path(__file__).parent / "results" / "deferred"
MODES = ("ar", "adaptive", "open at once")


def timed_request(engine: Engine, prompt: list[int], new_tokens: int) -> dict:
    """Time to first token, decode tokens/s (first token excluded) and the draft's open, one request."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    n, t_first, stats = 0, None, None
    t0 = time.perf_counter()
    for ev in engine.stream(prompt, params):
        if ev.token_ids and t_first is None:
            t_first = time.perf_counter()
        n += len(ev.token_ids)
        stats = ev.stats
    end = time.perf_counter()
    kinds = {k: v[0] for k, v in stats.step_kinds.items()}
    return dict(ttft_s=t_first - t0, tokens_per_s=(n - 1) / max(end - t_first, 1e-9), opened=stats.draft_open_s > 0,
                open_s=stats.draft_open_s, steps=kinds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="real", choices=sorted(e2e.PAIRS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--docs", default="shakespeare,nodejs")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=6)
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    target_name, draft_name = e2e.PAIRS[a.pair].target, e2e.PAIRS[a.pair].draft
    base = EngineConfig(target=target_name, draft=draft_name, mode="specextend", device=a.device,
                        dtype="float32" if a.device == "cpu" else "bfloat16")
    target, draft = load_pair(base)
    worker = draft_worker(base, draft)
    engines = {"ar": Engine(replace(base, mode="ar"), target, None),
               "adaptive": Engine(base, target, worker, draft_args=draft.args),
               "open at once": Engine(base, target, worker, draft_args=draft.args)}
    engines["open at once"].defer_opens = False
    meta = record.meta("deferred_open", a.device, ["benchmarks/deferred_open.py", *argv])
    rows = []
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"deferred-open-{a.pair}-{a.length}-{record.slug(record.device_name(a.device))}.json"
    for doc in documents(a.docs.split(",")):
        prompt = prompt_ids(target.tokenizer, doc, a.length)
        for engine in engines.values():
            warm_up(engine, prompt[:64])
        for rep in range(a.reps):
            for i, (mode, engine) in enumerate(engines.items()):  # a prompt of its own: no cache hit
                tag = target.tokenizer.encode(f"[{doc.name} {rep} {i}] ", add_special_tokens=False)
                row = dict(doc=doc.name, rep=rep, mode=mode, **timed_request(engine, list(tag) + prompt, a.new_tokens))
                rows.append(row)
                print(f"{doc.name} {rep} {mode:12s} ttft {row['ttft_s'] * 1e3:7.1f} ms  {row['tokens_per_s']:7.1f} tok/s"
                      f"  opened {row['opened']}  steps {row['steps']}", flush=True)
            path.write_text(json.dumps(dict(meta=meta, args=vars(a), rows=rows)) + "\n")  # (after every round)
    worker.shutdown()
    print("| doc | mode | TTFT ms (median) | decode tok/s (median) | x `ar` | requests that opened the draft |")
    print("|---|---|---|---|---|---|")
    for doc in a.docs.split(","):
        ar = statistics.median(r["tokens_per_s"] for r in rows if r["doc"] == doc and r["mode"] == "ar")
        for mode in MODES:
            rs = [r for r in rows if r["doc"] == doc and r["mode"] == mode]
            rate = statistics.median(r["tokens_per_s"] for r in rs)
            print(f"| {doc} | {mode} | {statistics.median(r['ttft_s'] for r in rs) * 1e3:.1f} | {rate:.1f} |"
                  f" {rate / ar:.2f}x | {sum(r['opened'] for r in rs)} of {len(rs)} |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
