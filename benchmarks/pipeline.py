"""Pipelined drafting (DESIGN 4) through a real gRPC draft server, on and off: decode tokens/s,
the per-step split, how often the guessed tree was ready (hits), and whether the output equals
plain greedy decoding. Target and draft run in two threads of one process (one torch thread each),
standing in for two devices.

  python benchmarks/pipeline.py --target default --draft default --dtype float32 \
      --text-file nodejs.txt --lengths 1024 --new-tokens 48
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from prompts import chat_prompt
from specextend.builder import load_draft, load_target
from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.draft.inprocess import InProcessDraft
from specextend.engine import Engine
from specextend.rpc import DraftServerThread, GrpcDraftBackend


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="random:llama-tiny")
    p.add_argument("--draft", default="random:llama-tiny-draft")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--mode", default="sd")
    p.add_argument("--lengths", default="1024")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--text-file", default=None)
    p.add_argument("--tree-nodes", type=int, default=16)
    p.add_argument("--tree-depth", type=int, default=6)
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared by both models)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = EngineConfig(target=a.target, draft=a.draft, dtype=a.dtype, mode=a.mode,
                       tree=TreeConfig(a.tree_nodes, a.tree_depth, a.tree_topk)).with_mode_defaults()
    target = load_target(cfg)
    draft = load_draft(cfg, target)
    params = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    rows = []
    for L in [int(x) for x in a.lengths.split(",")]:
        prompt = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(L)).tolist()
        if a.text_file:
            prompt = chat_prompt(target.tokenizer, open(a.text_file, encoding="utf-8").read(), L)
        ref, _, _ = Engine(EngineConfig(mode="ar"), target, None).generate(prompt, params)
        for pipeline in (False, True):
            with DraftServerThread(InProcessDraft(draft.decoder), pipeline=pipeline) as server:
                client = GrpcDraftBackend(server.address, timeout_s=600, open_timeout_s=600)
                try:
                    t0 = time.perf_counter()
                    out, _, s = Engine(cfg, target, client).generate(prompt, params)
                    wall = time.perf_counter() - t0
                finally:
                    client.shutdown()
            row = dict(length=len(prompt), pipeline=pipeline, decode_tokens_per_s=s.num_generated / s.decode_s,
                       wall_s=wall, steps=s.num_steps, mean_acceptance_length=s.mean_acceptance_length,
                       pipeline_hits=s.pipeline_hits, draft_ms_per_step=1e3 * s.draft_s / max(1, s.num_steps),
                       verify_ms_per_step=1e3 * s.verify_s / max(1, s.num_steps), identical_to_ar=out == ref,
                       accepted_per_step=s.accepted_per_step)
            rows.append(row)
            print({k: v for k, v in row.items() if k != "accepted_per_step"}, flush=True)
    print("\n| prompt tokens | pipeline | decode tok/s | steps | mean acc. len | hits | draft ms/step (wait) | "
          "verify ms/step | output == ar |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {'on' if r['pipeline'] else 'off'} | {r['decode_tokens_per_s']:.2f} | {r['steps']} | "
              f"{r['mean_acceptance_length']:.2f} | {r['pipeline_hits']} | {r['draft_ms_per_step']:.1f} | "
              f"{r['verify_ms_per_step']:.1f} | {r['identical_to_ar']} |")
    print(json.dumps(dict(target=a.target, draft=a.draft, dtype=a.dtype, mode=a.mode, threads=a.threads,
                          date=time.strftime("%Y-%m-%d"), rows=rows)))


if __name__ == "__main__":
    main()
