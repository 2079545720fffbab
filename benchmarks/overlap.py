"""Does a second GPU pay? The same engine in-process with the draft on the target's GPU, on its own
GPU, and on its own GPU drafting while the target verifies (docs/architecture.md, "Overlapped
drafting"), against plain decoding on the same kernels, in one run.

    python benchmarks/overlap.py --target T.gguf --draft D.gguf --text-file doc.txt --lengths 8192,16384

Modes: `ar` (GPU 0); `<mode>-1gpu` (draft on GPU 0); `<mode>-2gpu` (draft on GPU 1, no overlap);
`<mode>-2gpu-overlap` (draft on GPU 1, overlap on), for each speculative mode in --modes. On a
machine with one device (or the CPU) every "2gpu" mode shares the one device. Each speculative
run's output is checked against `ar` by the near-tie rule (docs/architecture.md, "Losslessness in
finite precision"). Prints a table and writes JSON (commit, device, date, command) under
benchmarks/results/overlap/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from prompts import chat_prompt
from specextend.builder import read_pair
from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.models.loader import load_model
from specextend.near_tie import near_tie_check

REPO = Path(__file__).resolve().parent.parent


def run(engine, prompt, new_tokens):
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompt[:2048], replace(params, max_new_tokens=64))  # warm-up (shapes, graphs)
    ids, _, st = engine.generate(prompt, params)
    steps = max(st.num_steps, 1)
    return ids, dict(
        decode_tokens_per_s=(st.num_generated - 1) / st.decode_s, ttft_s=st.prefill_s,
        mean_acceptance_length=st.mean_acceptance_length, num_steps=st.num_steps,
        step_ms=1e3 * st.decode_s / max(st.num_steps or st.num_generated - 1, 1),
        target_wait_ms=st.target_wait_ms_per_step, verify_ms=1e3 * st.verify_s / steps,
        tree_ready_fraction=st.tree_ready_fraction, draft_ahead_depth=st.draft_ahead_depth,
        draft_cache_tokens=st.draft_cache_tokens)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="random:llama-tiny")
    p.add_argument("--draft", default="random:llama-tiny-draft")
    p.add_argument("--text-file", default=None, help="real text (else random ids)")
    p.add_argument("--lengths", default="1024")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--modes", default="specextend", help="speculative modes, comma-separated (sd, specextend)")
    p.add_argument("--tree", default="16,6,4", help="nodes,depth,topk")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tree-policy", default="fixed", choices=("fixed", "adaptive"))
    p.add_argument("--overlap", default="8:3", help="overlap variants ROWS:SYNC_DEPTH, comma-separated (rows per "
                   "background forward; levels drafted before answering a step that found nothing ready, 0 = all)")
    p.add_argument("--tie-tol", type=float, default=0.125, help="near-tie tolerance (bf16 logits)")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/overlap"))
    a = p.parse_args()
    gpus = torch.cuda.device_count()
    dev0 = "cuda:0" if gpus else "cpu"
    dev1 = "cuda:1" if gpus > 1 else dev0
    base = EngineConfig(target=a.target, draft=a.draft, dtype=a.dtype, device=dev0, tree_policy=a.tree_policy,
                        tree=TreeConfig(*[int(x) for x in a.tree.split(",")]))
    t0 = time.perf_counter()
    target_meta, draft_meta = read_pair(base)
    target = load_model(target_meta, "target", a.dtype, dev0)
    vocab = target.args.vocab_size
    drafts = {dev0: load_model(draft_meta, "draft", a.dtype, dev0, vocab_size=vocab, target_weights=target.decoder.w)}
    if dev1 != dev0:
        drafts[dev1] = load_model(draft_meta, "draft", a.dtype, dev1, vocab_size=vocab, target_weights=None)
    print(f"loaded in {time.perf_counter() - t0:.0f} s; devices {dev0}, {dev1}", file=sys.stderr, flush=True)

    engines = {"ar": Engine(replace(base, mode="ar"), target)}
    workers = []
    for mode in [m for m in a.modes.split(",") if m]:
        variants = [(f"{mode}-1gpu", dev0, False, None), (f"{mode}-2gpu", dev1, False, None)]
        specs = [tuple(int(x) for x in v.split(":")) for v in a.overlap.split(",")]
        variants += [(f"{mode}-2gpu-overlap" + (f"-r{r}s{d}" if len(specs) > 1 else ""), dev1, True, (r, d))
                     for r, d in specs]
        for name, dev, overlap, (rows, sync) in [(n, d, o, v if o else (16, 0)) for n, d, o, v in variants]:
            cfg = replace(base, mode=mode, draft_overlap=overlap)
            worker = DraftWorker(drafts[dev].decoder, prefill_chunk=cfg.prefill_chunk, overlap=overlap,
                                 overlap_rows=rows, sync_depth=sync)
            worker.warm_up(DraftSessionParams(cfg.tree, cfg.retrieval, 64))
            workers.append(worker)
            engines[name] = Engine(cfg, target, worker)

    rows, checks = [], []
    text = open(a.text_file, encoding="utf-8").read() if a.text_file else None
    for L in [int(x) for x in a.lengths.split(",")]:
        if text is not None:
            prompt = chat_prompt(target.tokenizer, text, L)
        else:
            prompt = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(L)).tolist()
        ref = None
        for name, eng in engines.items():
            ids, r = run(eng, prompt, a.new_tokens)
            if name == "ar":
                ref = ids
            else:
                ok, div, gap = near_tie_check(target.decoder, prompt, ref, ids, a.tie_tol)
                checks.append(dict(length=L, mode=name, identical=div is None, near_tie=ok,
                                   first_divergence=div, top2_gap=gap))
            rows.append(dict(length=len(prompt), mode=name, **r))
            print(f"L={len(prompt)} {name}: {json.dumps(r)}", file=sys.stderr, flush=True)

    ar = {r["length"]: r["decode_tokens_per_s"] for r in rows if r["mode"] == "ar"}
    print("\n| L | mode | decode tok/s | x ar | mean acc. len | step ms | target wait ms | verify ms | "
          "ready | ahead depth |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {r['mode']} | {r['decode_tokens_per_s']:.1f} | "
              f"{r['decode_tokens_per_s'] / ar[r['length']]:.2f} | {r['mean_acceptance_length']:.2f} | "
              f"{r['step_ms']:.2f} | {r['target_wait_ms']:.2f} | {r['verify_ms']:.2f} | "
              f"{r['tree_ready_fraction']:.2f} | {r['draft_ahead_depth']:.2f} |")
    for c in checks:
        print(f"check L={c['length']} {c['mode']}: identical={c['identical']} near_tie={c['near_tie']} "
              f"first_divergence={c['first_divergence']} top2_gap={c['top2_gap']}")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip() or os.environ.get("SPECEXTEND_COMMIT", "unknown")
    except OSError:
        commit = os.environ.get("SPECEXTEND_COMMIT", "unknown")
    device = torch.cuda.get_device_name() if gpus else "cpu"
    meta = dict(commit=commit, device=f"{gpus}x {device}" if gpus else "cpu", date=time.strftime("%Y-%m-%d"),
                command=" ".join(sys.argv), target=a.target, draft=a.draft, text=a.text_file, tree=a.tree,
                dtype=str(target.decoder.dtype))
    out = Path(os.environ.get("OUT", a.out))
    out.mkdir(parents=True, exist_ok=True)
    name = f"overlap-{'gpu' if gpus else 'cpu'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    (out / name).write_text(json.dumps(dict(meta=meta, rows=rows, checks=checks), indent=1))
    for w in workers:
        w.stop()


if __name__ == "__main__":
    main()
