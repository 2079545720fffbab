"""Adaptive trees against plain decoding and the best fixed tree, regime by regime, in one process
(docs/architecture.md, "Adaptive speculation").

Per regime (a pair, a text, real or replayed acceptance): `ar`; `specextend` with fixed trees of
{4, 8, 16, 32} nodes x depth {3, 6}; `specextend` with the adaptive policy, its later requests
starting from the costs the engine's earlier ones measured, and the same warming up every request
(`adaptive cold`: Engine.carry_costs off). Runs are interleaved
(every configuration once, then again, `--reps` times) and each configuration's median decode
tokens/s is compared: goal, adaptive at least 0.95x the better of `ar` and the best fixed tree,
and never below 0.95x `ar`. Regimes on the CPU by default: the tiny pair on technical text and
prose, the tiny pair with acceptance replayed at 1.2, 2, 3 and 5 draft tokens a step (1.2 cycles
1,1,1,1,2), and a useless draft (the tiny target with a random 68M draft: one draft forward costs
far more than a target step and accepts nothing). On a GPU (`--device cuda`, bf16): the
Llama-3.1-8B geometry with the 68M draft, both with successor weights (models/presets.py: drafts
shaped like a real one's, whose trees can reach the replayed lengths), acceptance replayed at the
same rates; and the real pair (Qwen2.5-Coder 1.5B + 0.5B, the GGUF files fetch.py caches) on
technical text and on prose at the lengths issue 14 names (each regime its own prompt length).

  python benchmarks/regimes.py --reps 5 --new-tokens 48
  python benchmarks/regimes.py --device cuda --regimes real --tag real --new-tokens 128
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from specextend.bench import record
from specextend.bench.e2e import TIE_TOLERANCE
from specextend.bench.texts import documents, prompt_ids
from specextend.builder import draft_worker, load_pair
from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.engine import Engine
from specextend.near_tie import check_line, lossless_check
from specextend.warmup import warm_long, warm_up

OUT = Path(__file__).parent / "results" / "regimes"
TREES = [(n, d) for n in (4, 8, 16, 32) for d in (3, 6)]
REPLAYS = {"1.2": [1, 1, 1, 1, 2], "2": [2], "3": [3], "5": [5]}
# name -> (target, draft, document, replay)
REGIMES = {
    "tiny nodejs": ("random:llama-tiny", "random:llama-tiny-draft", "nodejs", None),
    "tiny shakespeare": ("random:llama-tiny", "random:llama-tiny-draft", "shakespeare", None),
    **{f"tiny replayed {k}": ("random:llama-tiny", "random:llama-tiny-draft", "nodejs", v) for k, v in REPLAYS.items()},
    "useless draft": ("random:llama-tiny", "random:llama-68m", "nodejs", None),
}
# on a GPU: the Llama-3.1-8B geometry (random weights) with the 68M draft, acceptance replayed
GPU_REGIMES = {f"8b replayed {k}": ("random:llama-3.1-8b-succ", "random:llama-68m-succ", "nodejs", v)
               for k, v in REPLAYS.items()}  # successor weights: trees as deep as a real draft's
# the real pair (GPU only: its 0.5B draft on a CPU is a minutes-long run), real acceptance, its own length
REAL_REGIMES = {f"real {doc} {n // 1000}K": ("default", "default", doc, None, n)
                for doc, lengths in (("nodejs", (1024, 4096, 16384, 30000)), ("shakespeare", (4096, 16384)))
                for n in lengths}
ALL_REGIMES = {**REGIMES, **GPU_REGIMES, **REAL_REGIMES}


def decode_rate(engine: Engine, prompt: list[int], new_tokens: int, replay) -> tuple[float, list[int], dict]:
    """Decode tokens/s (first token excluded: prefill), the tokens, and what the policy chose."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    tokens, t_first, stats = [], None, None
    t0 = time.perf_counter()
    for ev in engine.stream(prompt, params, replay=replay):
        if ev.token_ids and t_first is None:
            t_first = time.perf_counter()
        tokens += ev.token_ids
        stats = ev.stats
    wall = time.perf_counter() - (t_first or t0)
    info = dict(acceptance=stats.mean_acceptance_length, nodes=stats.mean_tree_nodes, plain_steps=stats.plain_steps,
                steps=stats.num_steps)
    return (len(tokens) - 1) / max(wall, 1e-9), tokens, info


def run_regime(name: str, reps: int, length: int, new_tokens: int, device: str = "cpu", progress=print) -> dict:
    target_name, draft_name, doc, replay, *own_length = ALL_REGIMES[name]
    length = own_length[0] if own_length else length
    base = EngineConfig(target=target_name, draft=draft_name, mode="specextend", device=device,
                        dtype="float32" if device == "cpu" else "bfloat16")
    target, draft = load_pair(base)
    # the draft's worker as the app builds it: with its prefix cache, so that a repeated prompt that
    # the target's prefix cache answers at once does not wait for the draft to prefill it again
    # (without it every request after the first waited for the draft's open: the real pair at 30K
    # read 0.57x `ar`, 2026-11-29)
    worker = draft_worker(replace(base, tree=TreeConfig(nodes=32, depth=6)), draft)
    prompt = prompt_ids(target.tokenizer, documents([doc])[0], length)
    configs = {"ar": Engine(replace(base, mode="ar"), target, None)}
    args = draft.args  # as the app and the CLI pass it: a draft that can never pay is not opened
    for n, d in TREES:
        configs[f"fixed {n}x{d}"] = Engine(replace(base, tree=TreeConfig(nodes=n, depth=d), tree_policy="fixed"),
                                           target, worker, draft_args=args)
    # adaptive may choose any tree of the grid: its bound is the largest
    configs["adaptive"] = Engine(replace(base, tree=TreeConfig(nodes=32, depth=6), tree_policy="adaptive"), target,
                                 worker, draft_args=args)
    # the same with every request warming up alone (no costs carried from the engine's last request)
    configs["adaptive cold"] = Engine(replace(base, tree=TreeConfig(nodes=32, depth=6), tree_policy="adaptive"),
                                      target, worker, draft_args=args)
    configs["adaptive cold"].carry_costs = False
    rates: dict[str, list[float]] = {k: [] for k in configs}
    infos: dict[str, dict] = {}
    checks: list[dict] = []  # outputs that differ from `ar`'s, each settled (near_tie.lossless_check)
    ref = None
    for engine in configs.values():  # warm-up: every shape a request can meet, as the served app's start-up
        warm_up(engine, prompt[:64])  # (a rung first met mid-run stalled one adaptive run at 41 tok/s)
        if engine.config.uses_draft:  # and what only a long prompt meets, as a served replica does: without it
            # the first speculative request's first tree waited 98-167 ms (8B geometry, 1K tokens, H200,
            # 2026-12-01, benchmarks/regime_trace.py), whichever configuration came first
            warm_long(engine, prompt[:64])
        engine.forget_text()  # (the warm-up's text taught the lookup gate nothing about the prompt's)
        engine.forget_costs()  # (the first request starts unprimed, as a served app's first request)
    for _ in range(reps):
        for key, engine in configs.items():
            rate, tokens, info = decode_rate(engine, prompt, new_tokens, replay if key != "ar" else None)
            rates[key].append(rate)
            infos[key] = info
            if key == "ar":
                ref = tokens
            elif replay is None and tokens != ref:  # settled by the near-tie rule (as the sweep does)
                check = lossless_check(target.decoder, prompt, ref, tokens, TIE_TOLERANCE.get(target.decoder.dtype, 0.125))
                checks.append(dict(config=key, **check))
                if not check["near_tie"]:
                    progress(f"{name} {key}: {check_line(check)}")
    worker.shutdown()
    del target, draft, worker, configs
    if device != "cpu":
        torch.cuda.empty_cache()
    med = {k: statistics.median(v) for k, v in rates.items()}
    best_fixed = max((k for k in med if k.startswith("fixed")), key=med.get)
    ar, ad = med["ar"], med["adaptive"]
    row = dict(regime=name, target=target_name, draft=draft_name, doc=doc, replay=replay, prompt_tokens=len(prompt),
               medians=med, runs=rates, chosen=infos, best_fixed=best_fixed, checks=checks,
               lossless=all(c["near_tie"] for c in checks),
               adaptive_vs_ar=ad / ar, adaptive_vs_best=ad / max(ar, med[best_fixed]),
               adaptive_cold_vs_best=med["adaptive cold"] / max(ar, med[best_fixed]),
               best_fixed_vs_ar=med[best_fixed] / ar)
    row["goal_met"] = row["adaptive_vs_best"] >= 0.95 and row["adaptive_vs_ar"] >= 0.95
    progress(f"{name:22s} ar {ar:6.1f}  best fixed {best_fixed:11s} {med[best_fixed]:6.1f}  adaptive {ad:6.1f} tok/s"
             f"  -> {row['adaptive_vs_ar']:.2f}x ar, {row['adaptive_vs_best']:.2f}x the better"
             f"  (adaptive: {infos['adaptive']['nodes']:.1f} nodes, {infos['adaptive']['plain_steps']} plain steps;"
             f" warming up every request: {row['adaptive_cold_vs_best']:.2f}x the better)"
             f"  {'ok' if row['goal_met'] else 'GOAL MISSED'}"
             + (f"; {len(checks)} outputs differ from ar's, "
                + ("all at near-ties" if row["lossless"] else "NOT ALL AT NEAR-TIES") if checks else ""))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regimes", default="", help="comma-separated, from: " + ", ".join(ALL_REGIMES)
                   + "; `real` names every real-pair regime (default: the device's replayed or tiny ones)")
    p.add_argument("--tag", default="", help="suffix of the results file (regimes-<device>-<tag>.json)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--length", type=int, default=1024, help="prompt tokens (document part)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (0: torch's): 1 as in a served replica (Ray starts its actors with "
                        "OMP_NUM_THREADS=1); with torch's two, the tiny pair's `ar` ran about 1.5x slower in process "
                        "beside the draft worker's thread (docs/architecture.md, \"Draft side\")")
    a = p.parse_args(argv)
    if a.threads and a.device == "cpu":
        torch.set_num_threads(a.threads)
    names = a.regimes.split(",") if a.regimes else list(REGIMES if a.device == "cpu" else GPU_REGIMES)
    names = [n for name in names for n in (REAL_REGIMES if name == "real" else [name])]
    unknown = [n for n in names if n not in ALL_REGIMES]
    if unknown:
        p.error(f"unknown regime(s) {unknown}; known: {', '.join(ALL_REGIMES)}")
    commit = record.commit()
    device = "cpu" if a.device == "cpu" else torch.cuda.get_device_name()
    meta = dict(commit=commit, device=device, date=datetime.date.today().isoformat(), cores=os.cpu_count(),
                threads=torch.get_num_threads(),
                command="python benchmarks/regimes.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "regimes-cpu" if a.device == "cpu" else f"regimes-{record.slug(record.device_name(a.device))}"
    path = OUT / (stem + (f"-{a.tag}" if a.tag else "") + ".json")
    rows = []
    for name in names:  # the file after every regime: a run cut by its time limit keeps what finished
        rows.append(run_regime(name, a.reps, a.length, a.new_tokens, a.device))
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
