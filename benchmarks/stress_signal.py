"""Stress the cross-model signal in the disaggregated shape (draft behind a real gRPC server):
inject RPC latency, apply chunk ids k steps late, drop updates, send them twice, run many sessions
at once, vary the refresh interval. For every setting: mean acceptance length, tokens/s, per-step
split, and whether the output still equals plain greedy decoding (docs/architecture.md, "Losslessness in finite precision").

  python benchmarks/stress_signal.py --target random:llama-tiny --draft random:llama-tiny-draft --dtype float64
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from specextend.builder import load_pair
from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.chaos import Chaos, ChaosDraft
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.near_tie import near_tie_check
from specextend.rpc import DraftServerThread, GrpcDraftBackend

SETTINGS = [  # (name, chaos, retrieval_every, concurrent sessions)
    ("baseline", Chaos(), 4, 1),
    ("latency 2ms", Chaos(latency_s=0.002), 4, 1),
    ("latency 10ms", Chaos(latency_s=0.010), 4, 1),
    ("ids 1 step late", Chaos(delay_steps=1), 4, 1),
    ("ids 4 steps late", Chaos(delay_steps=4), 4, 1),
    ("drop 50%", Chaos(drop_rate=0.5, seed=1), 4, 1),
    ("drop 100%", Chaos(drop_rate=1.0), 4, 1),
    ("duplicated", Chaos(duplicate=True), 4, 1),
    ("refresh every 1", Chaos(), 1, 1),
    ("refresh every 16", Chaos(), 16, 1),
    ("8 concurrent", Chaos(), 4, 8),
    ("8 concurrent, late+drop", Chaos(delay_steps=2, drop_rate=0.3, seed=3), 4, 8),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="random:llama-tiny")
    p.add_argument("--draft", default="random:llama-tiny-draft")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tie-tol", type=float, default=1e-6)
    a = p.parse_args()
    cfg = EngineConfig(target=a.target, draft=a.draft, dtype=a.dtype)
    target, draft = load_pair(cfg)
    server = DraftServerThread(DraftWorker(draft.decoder), "127.0.0.1", 0)
    client = GrpcDraftBackend(server.address, timeout_s=60)
    params = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    prompts = [torch.randint(0, 256, (a.prompt_tokens,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in range(8)]
    ar = Engine(replace(cfg, mode="ar"), target)
    refs = [ar.generate(pr, params)[0] for pr in prompts]
    rows = []
    for name, chaos, every, conc in SETTINGS:
        retrieval = RetrievalConfig(enabled=True, chunk_size=a.chunk_size, top_k=a.top_k, every=every,
                                    draft_prefill_window=64)
        eng = Engine(replace(cfg, mode="specextend", tree=TreeConfig(16, 5, 4), retrieval=retrieval), target,
                     ChaosDraft(client, chaos))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(conc) as pool:
            results = list(pool.map(lambda i: eng.generate(prompts[i], params), range(conc)))
        wall = time.perf_counter() - t0
        checks = [near_tie_check(target.decoder, prompts[i], refs[i], results[i][0], a.tie_tol) for i in range(conc)]
        stats = [r[2] for r in results]
        steps = sum(s.num_steps for s in stats)
        rows.append(dict(
            setting=name, sessions=conc, retrieval_every=every, lossless=all(c[0] for c in checks),
            identical=all(c[1] is None for c in checks), fallbacks=sum(s.fallback for s in stats),
            mean_acceptance_length=sum(s.mean_acceptance_length for s in stats) / conc,
            tokens_per_s=sum(s.num_generated for s in stats) / wall,
            draft_ms_per_step=1e3 * sum(s.draft_s for s in stats) / steps,
            verify_ms_per_step=1e3 * sum(s.verify_s for s in stats) / steps,
            refreshes=sum(s.retrieval_refreshes for s in stats), dropped=eng.draft.dropped))
        r = rows[-1]
        print(f"{name}: {r}", flush=True)
    client.shutdown()
    server.stop()
    print("\n| setting | sessions | lossless | identical | mean acc. len | tok/s | draft ms/step (incl. RPC) | "
          "verify ms/step | updates sent | dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['sessions']} | {r['lossless']} | {r['identical']} | "
              f"{r['mean_acceptance_length']:.2f} | {r['tokens_per_s']:.1f} | {r['draft_ms_per_step']:.2f} | "
              f"{r['verify_ms_per_step']:.2f} | {r['refreshes']} | {r['dropped']} |")
    meta = dict(target=a.target, draft=a.draft, dtype=a.dtype, prompt_tokens=a.prompt_tokens,
                new_tokens=a.new_tokens, budget=f"{a.top_k}x{a.chunk_size}", date=time.strftime("%Y-%m-%d"),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    print(json.dumps(dict(meta=meta, rows=rows)))


if __name__ == "__main__":
    main()
