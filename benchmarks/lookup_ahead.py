"""Lookup runs ahead of the host, on and off (docs/architecture.md, "Lookup runs ahead"), beside `ar`,
in one process on the same prompts: `lookup` (chains alone) and `specextend` with the adaptive policy,
each with runs (`Engine.lookup_ahead` True) and without (False: every step the host's way). Runs are
interleaved (every configuration once, then again, `--reps` times); medians of decode tokens/s, the
steps taken, and every output against `ar`'s (identical, or first differing at a near-tie).

  python benchmarks/lookup_ahead.py --docs shakespeare,python --length 16384 --reps 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from specextend.bench import record
from specextend.bench.e2e import TIE_TOLERANCE
from specextend.bench.texts import documents, prompt_ids
from specextend.builder import draft_worker, load_pair
from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.engine import Engine
from specextend.near_tie import lossless_check
from specextend.warmup import warm_up

OUT = Path(__file__).parent / "results" / "lookup_ahead"


def decode(engine: Engine, prompt: list[int], new_tokens: int, temperature: float = 0.0,
           seed: int = 0, top_p: float = 0.95) -> tuple[float, list[int], dict]:
    import time
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=temperature, top_p=top_p,
                            seed=seed if temperature else None)
    tokens, t_first, stats = [], None, None
    t0 = time.perf_counter()
    for ev in engine.stream(prompt, params):
        if ev.token_ids and t_first is None:
            t_first = time.perf_counter()
        tokens += ev.token_ids
        stats = ev.stats
    rate = (len(tokens) - 1) / max(time.perf_counter() - (t_first or t0), 1e-9)
    kinds = {k: dict(steps=v[0], tokens=v[1], ms_per_step=round(1e3 * v[2] / max(v[0], 1), 3))
             for k, v in stats.step_kinds.items()}
    return rate, tokens, dict(kinds=kinds, lookup_accepted=stats.lookup_accepted, trees=stats.num_steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", default="shakespeare,python")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tag", default="")
    p.add_argument("--target", default="default")
    p.add_argument("--draft", default="default")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampled requests (top_p 0.95, seed = the rep's number): outputs compared with ar's "
                        "of the same seed, equal or not (bf16 rounding moves samples near a CDF step)")
    p.add_argument("--top-p", type=float, default=0.95, help="sampled requests' top_p (1: fused_sample's kernels)")
    a = p.parse_args(argv)
    base = EngineConfig(target=a.target, draft=a.draft, mode="specextend", device=a.device, dtype="bfloat16" if a.device == "cuda" else "float32")
    target, draft = load_pair(base)
    worker = draft_worker(replace(base, tree=TreeConfig(nodes=32, depth=6)), draft)
    configs = {"ar": Engine(replace(base, mode="ar"), target, None)}
    for ahead in (False, True):
        tag = "runs" if ahead else "host"
        configs[f"lookup {tag}"] = Engine(replace(base, mode="lookup"), target, None)
        configs[f"adaptive {tag}"] = Engine(replace(base, tree=TreeConfig(nodes=32, depth=6), tree_policy="adaptive"),
                                            target, worker, draft_args=draft.args)
        configs[f"lookup {tag}"].lookup_ahead = configs[f"adaptive {tag}"].lookup_ahead = ahead
    rows = []
    for doc in a.docs.split(","):
        prompt = prompt_ids(target.tokenizer, documents([doc])[0], a.length)
        for engine in configs.values():
            warm_up(engine, prompt[:64])
        rates = {k: [] for k in configs}
        info, checks, ref, same = {}, [], None, {k: 0 for k in configs}
        for rep in range(a.reps):
            for key, engine in configs.items():
                rate, tokens, info[key] = decode(engine, prompt, a.new_tokens, a.temperature, rep, a.top_p)
                rates[key].append(rate)
                same[key] += key != "ar" and tokens == ref
                if key == "ar":
                    ref = tokens
                elif tokens != ref and not a.temperature:
                    c = lossless_check(target.decoder, prompt, ref, tokens, TIE_TOLERANCE.get(target.decoder.dtype, 0.125))
                    checks.append(dict(config=key, **c))
        med = {k: statistics.median(v) for k, v in rates.items()}
        row = dict(doc=doc, prompt_tokens=len(prompt), temperature=a.temperature, top_p=a.top_p, same_as_ar=same,
                   medians=med, runs=rates, chosen=info, checks=checks,
                   lossless=all(c["near_tie"] for c in checks), vs_ar={k: v / med["ar"] for k, v in med.items()})
        rows.append(row)
        print(f"{doc} {len(prompt)} tokens: " + "  ".join(f"{k} {v:.1f} ({v / med['ar']:.2f}x)" for k, v in med.items())
              + (f"  lossless={row['lossless']} ({len(checks)} differ)" if not a.temperature
                 else f"  same as ar's seeded output: {same}"))
        for k in configs:
            print(f"   {k:14s} {info[k]}")
    worker.shutdown()
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    meta = dict(commit=record.commit(), device=device, date=datetime.date.today().isoformat(),
                command="python benchmarks/lookup_ahead.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / (f"lookup_ahead-{record.slug(record.device_name(a.device))}" + (f"-{a.tag}" if a.tag else "") + ".json")
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
