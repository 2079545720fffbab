"""Questions over one long document, with and without the prefix cache: each question's time to
first token (the target's prefill of what the cache does not hold), its cached tokens, and whether
its output equals the one without the cache (docs/architecture.md, "Prefix caching").

In process, one engine, the same prompts twice: first with the cache off, then on (cold for the
first question, warm for the rest). Prints a table, writes JSON (commit, device, date, command).

    python benchmarks/prefix_cache.py --length 2048 --questions 3            # the real pair's target, CPU
    python benchmarks/prefix_cache.py --length 16384 --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from specextend.bench.record import device_name, meta, slug
from specextend.bench.texts import BY_NAME, prompt_ids
from specextend.builder import build_engine
from specextend.config import EngineConfig, SamplingParams
from specextend.prefix_cache import PrefixCache

QUESTIONS = ["Summarise the text above in one sentence.", "What is the main topic of the text above?",
             "List three terms the text above defines.", "Which example in the text above is the longest?"]


def first_token(engine, prompt: list[int], new_tokens: int) -> tuple[float, list[int], int]:
    """(seconds to the first token, the tokens, prompt tokens the cache held)."""
    t0, ttft, out, stats = time.perf_counter(), None, [], None
    for ev in engine.stream(prompt, SamplingParams(new_tokens, ignore_eos=True)):
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        out += ev.token_ids
        stats = ev.stats
    return ttft, out, stats.cached_prompt_tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--doc", default="nodejs", choices=sorted(BY_NAME))
    p.add_argument("--length", type=int, default=2048, help="document tokens")
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix"))
    a = p.parse_args(argv)
    cfg = EngineConfig(target=a.target, mode="ar", device=a.device, dtype=a.dtype)
    engine = build_engine(cfg)
    tok = engine.target.tokenizer
    prompts = [prompt_ids(tok, replace(BY_NAME[a.doc], question=q), a.length) for q in QUESTIONS[:a.questions]]
    first_token(engine, prompts[0][-64:], 2)  # warm the kernels on a short prompt
    rows = []
    for cached in (False, True):
        engine.prefix_cache = PrefixCache.of(cfg) if cached else None
        for i, prompt in enumerate(prompts):
            ttft, out, hit = first_token(engine, prompt, a.new_tokens)
            rows.append(dict(cache=cached, question=i, prompt_tokens=len(prompt), cached_tokens=hit, ttft_s=ttft,
                             tokens=out))
            print(f"cache {'on ' if cached else 'off'} question {i}: {len(prompt)} tokens, {hit} cached, "
                  f"first token in {ttft:.3f} s", file=sys.stderr, flush=True)
    off, on = rows[:len(prompts)], rows[len(prompts):]
    table = ["| question | prompt tokens | cached | first token, cache off (s) | cache on (s) | speed-up | same output |",
             "|---|---|---|---|---|---|---|"]
    for o, c in zip(off, on):
        table.append(f"| {o['question']} | {o['prompt_tokens']} | {c['cached_tokens']} | {o['ttft_s']:.3f} | "
                     f"{c['ttft_s']:.3f} | {o['ttft_s'] / c['ttft_s']:.2f}x | {o['tokens'] == c['tokens']} |")
    print("\n".join(table))
    dev = device_name(a.device)
    record = dict(meta=meta("prefix_cache", a.device, [], target=a.target, length=a.length, doc=a.doc,
                            prefill_chunk=cfg.prefill_chunk, dtype=str(engine.target.decoder.dtype)), rows=rows)
    record["meta"]["command"] = " ".join(["python", "benchmarks/prefix_cache.py", *(sys.argv[1:] if argv is None else argv)])
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"{slug(dev)}-{a.length}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    return 0 if all(o["tokens"] == c["tokens"] for o, c in zip(off, on)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
