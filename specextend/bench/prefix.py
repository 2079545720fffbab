"""The prefix suite (`specextend bench --suite prefix`): several questions over one long document,
the prefix cache off and then on (docs/architecture.md, "Prefix caching"). Per question: the time
to the first token (the target's prefill of what the cache does not hold), the prompt tokens
cached on the target and on the draft, the draft's open (its prefill, with speculative modes) and
the output, which must equal the one without the cache."""

from __future__ import annotations

from dataclasses import replace
from statistics import mean

from specextend.bench import e2e
from specextend.bench.texts import documents, prompt_ids
from specextend.config import EngineConfig, SamplingParams
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.prefix_cache import PrefixCache

QUESTIONS = ("Summarise the text above in one sentence.", "What is the main topic of the text above?",
             "List three terms the text above defines.")


def _engine(base, mode: str, target, draft) -> Engine:
    cfg = replace(base, **e2e.MODES[mode], prefix_cache_gb=EngineConfig().prefix_cache_gb)
    backend = DraftWorker(draft.decoder, prefill_chunk=cfg.prefill_chunk) if cfg.uses_draft else None
    return Engine(cfg, target, backend)


def _caches(engine: Engine, on: bool) -> PrefixCache | None:
    """Fresh caches on both sides (on) or none (off); the draft's, to read its hits."""
    engine.prefix_cache = PrefixCache.of(engine.config) if on else None
    if engine.draft is not None:
        engine.draft.prefix_cache = PrefixCache.of(engine.config) if on else None
        return engine.draft.prefix_cache
    return None


def run(pairs: dict[str, list[int]], modes: list[str], new_tokens: int, docs: dict[str, list[str]], dtype: str,
        tree_policy: str, device: str, progress=print) -> dict:
    rows = []
    for pair_name, lengths in pairs.items():
        base, target, drafts = e2e.load_models(e2e.PAIRS[pair_name], dtype, tree_policy, device)
        engines = {mode: _engine(base, mode, target, drafts[base.device]) for mode in modes}
        warm: set = set()
        for length in lengths:
            for doc in documents(docs[pair_name]):
                prompts = [prompt_ids(target.tokenizer, replace(doc, question=q), length) for q in QUESTIONS]
                for mode, engine in engines.items():
                    e2e.warm_up(engine, prompts[0], warm)
                    for on in (False, True):
                        draft_cache = _caches(engine, on)
                        for i, prompt in enumerate(prompts):
                            before = draft_cache.hits if draft_cache is not None else 0
                            out, _, st = engine.generate(prompt, SamplingParams(new_tokens, ignore_eos=True))
                            rows.append(dict(pair=pair_name, length=length, doc=doc.name, mode=mode, cache=on,
                                             question=i, prompt_tokens=len(prompt),
                                             cached_tokens=st.cached_prompt_tokens,
                                             draft_cached_tokens=(draft_cache.hits - before) if draft_cache else 0,
                                             ttft_s=st.prefill_s, draft_open_ms=1e3 * st.draft_open_s,
                                             open_steps=st.open_steps, tokens=out))
                            r = rows[-1]
                            progress(f"{pair_name} {length} {doc.name} {mode} cache {'on' if on else 'off'} "
                                     f"question {i}: {r['cached_tokens']} of {len(prompt)} cached, "
                                     f"first token {r['ttft_s']:.3f} s")
        for engine in engines.values():
            if engine.draft is not None:
                engine.draft.shutdown()
    return dict(rows=rows, summary=summarize(rows))


def summarize(rows: list[dict]) -> list[dict]:
    """Per (pair, length, document, mode): the later questions' (the first fills the cache) time to
    first token and draft open, off and on, and whether every output equals its uncached twin."""
    out = []
    keys = dict.fromkeys((r["pair"], r["length"], r["doc"], r["mode"]) for r in rows)
    for key in keys:
        group = [r for r in rows if (r["pair"], r["length"], r["doc"], r["mode"]) == key]
        off = {r["question"]: r for r in group if not r["cache"]}
        on = {r["question"]: r for r in group if r["cache"]}
        later = [q for q in off if q > 0 and q in on]
        ttft_off, ttft_on = (mean(d[q]["ttft_s"] for q in later) for d in (off, on))
        out.append(dict(pair=key[0], length=key[1], doc=key[2], mode=key[3], ttft_off_s=ttft_off, ttft_on_s=ttft_on,
                        speedup=ttft_off / max(ttft_on, 1e-9), cached_tokens=mean(on[q]["cached_tokens"] for q in later),
                        draft_cached_tokens=mean(on[q]["draft_cached_tokens"] for q in later),
                        draft_open_off_ms=mean(off[q]["draft_open_ms"] for q in later),
                        draft_open_on_ms=mean(on[q]["draft_open_ms"] for q in later),
                        same_output=all(off[q]["tokens"] == on[q]["tokens"] for q in on)))
    return out


def table(result: dict) -> str:
    lines = ["| pair | length | document | mode | cached (target / draft) | first token off (s) | on (s) | speed-up "
             "| draft open off / on (ms) | outputs equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        lines.append(f"| {s['pair']} | {s['length']} | {s['doc']} | {s['mode']} | {s['cached_tokens']:.0f} / "
                     f"{s['draft_cached_tokens']:.0f} | {s['ttft_off_s']:.3f} | {s['ttft_on_s']:.3f} | "
                     f"{s['speedup']:.2f}x | {s['draft_open_off_ms']:.0f} / {s['draft_open_on_ms']:.0f} | "
                     f"{s['same_output']} |")
    return "\n".join(lines)


def glance(run: dict) -> str:
    parts = []
    for s in run["summary"]:
        parts.append(f"{s['pair']} pair, {s['mode']}, {s['length']} tokens: first token {s['ttft_off_s']:.3f} -> "
                     f"{s['ttft_on_s']:.3f} s ({s['speedup']:.1f}x) for later questions"
                     + ("" if s["same_output"] else ", OUTPUTS DIFFER"))
    return "; ".join(parts)


def plot(summary: list[dict], stem, title: str) -> list:
    from specextend.bench.plots import _panels, _pyplot, _save, _style

    plt = _pyplot()
    pairs = sorted({s["pair"] for s in summary})
    fig, axes = _panels(plt, pairs, title)
    for pair, ax in axes.items():
        rows = [s for s in summary if s["pair"] == pair]
        for mode in dict.fromkeys(s["mode"] for s in rows):
            pts = sorted((s["length"], s["ttft_off_s"], s["ttft_on_s"]) for s in rows if s["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode}, cache off")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="s", linestyle="--", label=f"{mode}, cache on")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _style(ax, "document tokens", "time to first token (s), later questions", pair)
    return [_save(plt, fig, stem.parent / f"{stem.name}-ttft.png")]
