"""End-to-end decoding on one device (docs/architecture.md, "Baselines"): ar-hf, ar, sd and specextend in one run.

With random weights the draft agrees with its target almost never, so timing uses acceptance
replay (results say "replayed"): each step accepts the length recorded in a trace of a real run.
A short unreplayed `sd` vs `ar` run checks losslessness (near-tie rule, docs/architecture.md).

  python benchmarks/e2e.py --target random:llama-3.1-8b --draft random:llama-68m \
      --lengths 8192,16384 --replay-trace benchmarks/traces/FILE.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.models.loader import load_model
from prompts import chat_prompt
from specextend.near_tie import near_tie_check, rounding_noise


def hf_generate_tps(target, prompt, new_tokens) -> float:
    """transformers `generate` (greedy) on an HF model with the same geometry (random init)."""
    from transformers import AutoModelForCausalLM

    with torch.device(target.decoder.device):  # initialise on the GPU (an 8B CPU init takes minutes)
        hf = AutoModelForCausalLM.from_config(target.hf_config, dtype=target.decoder.dtype)
    ids = torch.tensor([prompt], device=target.decoder.device)
    hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
    torch.cuda.synchronize() if ids.is_cuda else None
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize() if ids.is_cuda else None
    dt = time.perf_counter() - t0
    del hf
    torch.cuda.empty_cache() if ids.is_cuda else None
    return new_tokens / dt


def run(engine, prompt, new_tokens, replay):
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompt[:64], replace(params, max_new_tokens=8), replay=replay)  # warm-up
    ids, _, st = engine.generate(prompt, params, replay=replay)
    steps = max(st.num_steps, 1)
    return ids, dict(
        tokens_per_s=st.tokens_per_s, decode_tokens_per_s=(st.num_generated - 1) / st.decode_s,
        ttft_s=st.prefill_s, mean_acceptance_length=st.mean_acceptance_length, num_steps=st.num_steps,
        draft_ms_per_step=1e3 * st.draft_s / steps, verify_ms_per_step=1e3 * st.verify_s / steps,
        step_ms=1e3 * st.decode_s / max(st.num_steps or st.num_generated - 1, 1),
        draft_cache_tokens=st.draft_cache_tokens, retrieval_refreshes=st.retrieval_refreshes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="random:llama-3.1-8b")
    p.add_argument("--draft", default="random:llama-68m")
    p.add_argument("--lengths", default="8192,16384")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--replay-trace", default=None)
    p.add_argument("--replay-constant", type=int, default=3)
    p.add_argument("--no-replay", action="store_true", help="real acceptance (real models)")
    p.add_argument("--text-file", default=None, help="real text: the first L tokens, then a question, chat template")
    p.add_argument("--tree-nodes", type=int, default=32)
    p.add_argument("--tree-depth", type=int, default=6)
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--check-tokens", type=int, default=48)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--execution", default="auto", choices=("auto", "graphs", "eager"))
    p.add_argument("--tie-tol", type=float, default=0.125, help="near-tie tolerance for bf16 logits")
    a = p.parse_args()
    replay = None if a.no_replay else [a.replay_constant]
    if a.replay_trace:
        replay = json.load(open(a.replay_trace))["accepted_per_step"]
    kw = dict(execution=a.execution)
    target = load_model(a.target, "target", **kw)
    draft = load_model(a.draft, "draft", vocab_size=target.args.vocab_size, target_weights=target.decoder.w, **kw)
    dev = target.decoder.device
    tree = TreeConfig(a.tree_nodes, a.tree_depth, a.tree_topk)
    engines = {
        "ar": Engine(EngineConfig(mode="ar"), target),
        "sd": Engine(EngineConfig(mode="sd", tree=tree), target, DraftWorker(draft.decoder)),
        "specextend": Engine(EngineConfig(mode="specextend", tree=tree, retrieval=RetrievalConfig(
            enabled=True, draft_prefill_window=512)), target, DraftWorker(draft.decoder)),
    }
    rows, checks = [], []
    for L in [int(x) for x in a.lengths.split(",")]:
        prompt = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(L)).tolist()
        if a.text_file:
            prompt = chat_prompt(target.tokenizer, open(a.text_file, encoding="utf-8").read(), L)
        # losslessness check (no replay): sd and specextend vs ar, first divergence at a near-tie?
        ref, _ = run(engines["ar"], prompt, a.check_tokens, None)
        for mode in [m for m in engines if m != "ar"]:
            out, _ = run(engines[mode], prompt, a.check_tokens, None)
            ok, div, gap = near_tie_check(target.decoder, prompt, ref, out, a.tie_tol)
            noise = rounding_noise(target.decoder, list(prompt) + ref[:div]) if div is not None else None
            checks.append(dict(length=L, mode=mode, identical=div is None, near_tie=ok, first_divergence=div,
                               top2_gap=gap, rounding_noise=noise,
                               within_noise=div is None or (gap is not None and gap <= 2 * noise)))
        for mode, eng in engines.items():
            _, r = run(eng, prompt, a.new_tokens, None if mode == "ar" else replay)
            rows.append(dict(length=L, mode=mode, replayed=mode != "ar" and replay is not None, **r))
            print(f"L={L} {mode}: {r}", flush=True)
        if not a.skip_hf:
            rows.append(dict(length=L, mode="ar-hf", replayed=False,
                             decode_tokens_per_s=hf_generate_tps(target, prompt, min(a.new_tokens, 32))))
    print("\n| L | mode | tok/s (incl. prefill) | decode tok/s | TTFT s | mean acc. len | step ms | draft ms | "
          "verify ms | draft cache |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = lambda k, fmt="{:.2f}": fmt.format(r[k]) if k in r else "-"  # noqa: E731
        print(f"| {r['length']} | {r['mode']}{' (replayed)' if r['replayed'] else ''} | {f('tokens_per_s', '{:.1f}')} | "
              f"{f('decode_tokens_per_s', '{:.1f}')} | {f('ttft_s', '{:.3f}')} | {f('mean_acceptance_length')} | "
              f"{f('step_ms')} | {f('draft_ms_per_step')} | {f('verify_ms_per_step')} | {r.get('draft_cache_tokens', '-')} |")
    for c in checks:
        print(f"check L={c['length']} {c['mode']}: identical={c['identical']} near_tie={c['near_tie']} "
              f"first_divergence={c['first_divergence']} "
              f"top2_gap={c['top2_gap']} rounding_noise={c['rounding_noise']} within_noise={c['within_noise']}")
    meta = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", target=a.target,
                draft=a.draft, dtype=str(target.decoder.dtype), tree=[a.tree_nodes, a.tree_depth, a.tree_topk],
                replay=None if replay is None else (a.replay_trace or f"constant {a.replay_constant}"),
                text=a.text_file, execution=a.execution, date=time.strftime("%Y-%m-%d"))
    print(json.dumps(dict(meta=meta, rows=rows, checks=checks)))


if __name__ == "__main__":
    main()
