"""End-to-end decoding in one process: every baseline on the same prompts, in one run
(docs/architecture.md, "Baselines"). Used by the `e2e` and `sweep` suites.

Modes (`MODES`): `ar` our plain decoding, the honest baseline; `sd` tree speculative decoding as a
modern server runs it (HTA verification, the draft's full cache); `sd-masked` the same with plain
masked verification (the SpecExtend paper's baseline); `specextend` (HTA + retrieval). With two
GPUs, `sd-2gpu` and `specextend-2gpu` put the draft on the second GPU, drafting while the target
verifies; `sd-overlap` and `specextend-overlap` overlap the same way with the draft on the target's
GPU (its own CUDA stream: docs/architecture.md, "Overlapped drafting"). `hf` and `hf-assisted` are transformers `generate` without and with assisted generation
on the same weights and device (bench/hf.py), the external anchor.

Pairs with random weights cannot accept anything real: their speculative modes replay the
per-step accepted lengths of real-pair traces (`traces/`) and are labelled "replayed"; pairs with
real acceptance check every speculative output against `ar` by the near-tie rule
(docs/architecture.md, "Losslessness in finite precision").
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from specextend.bench import hf as hf_anchor
from specextend.bench.texts import documents, prompt_ids
from specextend.builder import read_pair
from specextend.config import EngineConfig, RetrievalConfig, SamplingParams
from specextend.draft.worker import DraftWorker
from specextend import warmup
from specextend.engine import Engine
from specextend.models.loader import load_model
from specextend.near_tie import check_line, overrides_of, reference_check

log = logging.getLogger(__name__)
TRACES = Path(__file__).resolve().parent / "traces"


@dataclass(frozen=True)
class Pair:
    target: str
    draft: str
    replayed: bool  # random weights: acceptance replayed from real-pair traces


PAIRS = {
    "tiny": Pair("random:llama-tiny", "random:llama-tiny-draft", False),  # correlated random pair (presets.py)
    "real": Pair("default", "default", False),  # Qwen2.5-Coder 1.5B + 0.5B (fetch.py)
    "8b": Pair("random:llama-3.1-8b", "random:llama-68m", True),
    "8b-1b": Pair("random:llama-3.1-8b", "random:llama-3.2-1b", True),  # the 1B-geometry draft (16 layers)
    # successor weights (presets.successor_weights): drafts as confident as a real one's, plain and
    # bonus tokens the draft ranks first or second, as a real pair's are (what overlap depends on)
    "8b-succ": Pair("random:llama-3.1-8b-succ", "random:llama-68m-succ", True),
    "8b-1b-succ": Pair("random:llama-3.1-8b-succ", "random:llama-3.2-1b-succ", True),
}
# EngineConfig fields of each speculative or plain mode of our engine. Each mode states its retrieval:
# a config built in one mode and replaced into another keeps the first mode's resolved defaults.
NO_RETRIEVAL = RetrievalConfig(enabled=False)
MODES = {
    "ar": dict(mode="ar"),
    "lookup": dict(mode="lookup", hybrid_attention=True, retrieval=NO_RETRIEVAL),
    "sd": dict(mode="sd", hybrid_attention=True, retrieval=NO_RETRIEVAL),
    "sd-masked": dict(mode="sd", hybrid_attention=False, retrieval=NO_RETRIEVAL),
    "specextend": dict(mode="specextend", retrieval=RetrievalConfig(enabled=True)),
}
LABELS = {
    "ar": "ar: our plain decoding (the baseline)",
    "lookup": "lookup: context lookup alone, no draft model (n-gram drafts)",
    "sd": "sd: tree SD, HTA verify, full draft cache (a modern server's)",
    "sd-masked": "sd-masked: tree SD, masked verify (the SpecExtend paper's baseline)",
    "specextend": "specextend: HTA + retrieval",
    "sd-2gpu": "sd on two GPUs (draft on its own, overlapped)",
    "specextend-2gpu": "specextend on two GPUs (draft on its own, overlapped)",
    "sd-overlap": "sd on one GPU, overlapped (the draft on its own stream)",
    "specextend-overlap": "specextend on one GPU, overlapped (the draft on its own stream)",
    "hf": "transformers generate",
    "hf-assisted": "transformers assisted generation",
}
HF_MODES = ("hf", "hf-assisted")
TIE_TOLERANCE = {torch.bfloat16: 0.125, torch.float16: 0.0157, torch.float32: 1e-3, torch.float64: 0.0}


def trace_for(mode: str, length: int) -> tuple[str, list[int]]:
    """The real-pair trace replayed for `mode` at `length`: its name and accepted lengths per step."""
    kind = "specextend" if mode.startswith("specextend") else "sd"
    size = 2048 if length >= 2048 else 1024
    path = TRACES / f"qwen2.5-coder-{kind}-{size}.json"
    return path.name, [int(x) for x in json.loads(path.read_text())["accepted_per_step"]]


def load_models(pair: Pair, dtype: str, tree_policy: str, device: str, draft_devices: tuple[str, ...] = ()):
    """The pair's base config and its target on cuda:0 (or the CPU); a draft on the same device
    (sharing the target's weights where it can), and one more on each of `draft_devices`."""
    gpus = torch.cuda.device_count() if device != "cpu" else 0
    dev0 = "cuda:0" if gpus else "cpu"
    base = EngineConfig(target=pair.target, draft=pair.draft, dtype=dtype, device=dev0, tree_policy=tree_policy,
                        prefix_cache_gb=0)  # (every request prefills its whole prompt: the prefix suite measures the cache)
    target_meta, draft_meta = read_pair(base)
    target = load_model(target_meta, "target", dtype, dev0, execution=base.execution)
    vocab = target.args.vocab_size
    drafts = {dev0: load_model(draft_meta, "draft", dtype, dev0, vocab_size=vocab, target_weights=target.decoder.w)}
    for dev in draft_devices:
        drafts[dev] = load_model(draft_meta, "draft", dtype, dev, vocab_size=vocab, target_weights=None)
    return base, target, drafts


def _engines(pair: Pair, modes: list[str], dtype: str, tree_policy: str, device: str):
    """Loads the pair (a second draft on cuda:1 for the -2gpu modes) and builds each mode's engine."""
    two_gpu = any(m.endswith("-2gpu") for m in modes)
    base, target, drafts = load_models(pair, dtype, tree_policy, device, ("cuda:1",) if two_gpu else ())
    draft = drafts[base.device]
    engines, workers = {}, []
    for mode in modes:
        if mode in HF_MODES:
            continue
        two = mode.endswith("-2gpu")
        overlap = two or mode.endswith("-overlap")
        cfg = replace(base, **MODES[mode.removesuffix("-2gpu").removesuffix("-overlap")], draft_overlap=overlap)
        backend = None
        if cfg.uses_draft:
            model = draft
            if two:
                model = drafts["cuda:1"]
            backend = DraftWorker(model.decoder, prefill_chunk=cfg.prefill_chunk, overlap=overlap)  # warmed on first use
            workers.append(backend)
        engines[mode] = Engine(cfg, target, backend)
    wanted = [m for m in modes if m in HF_MODES and not (m == "hf-assisted" and pair.replayed)]
    anchors = {m: a for m, a in hf_anchor.anchors(target, draft).items() if m in wanted} if wanted else {}
    return target, engines, anchors, workers


def warm_up(engine: Engine, prompt: list[int], warm: set, replay: Optional[list[int]] = None) -> None:
    """A short request on `engine`'s first use (shapes, graphs, lazy initialisation); `warm` holds
    the ids of the engines already warm."""
    if id(engine) not in warm:
        engine.generate(prompt[:64], SamplingParams(max_new_tokens=8, ignore_eos=True), replay=replay)
        if engine.target.decoder.graphs is not None:  # every shape's graphs, before the timed runs
            warmup.warm_up(engine, prompt[:64])
            if engine.config.uses_draft:  # and what only a long prompt meets, as a served replica does
                warmup.warm_long(engine, prompt[:64])
        engine.forget_text()  # (the warm-up's text taught the lookup gate nothing about the prompts': as served)
        engine.forget_costs()  # (its first request met every shape cold: a served app's first request starts unprimed)
        warm.add(id(engine))


def run_engine(engine: Engine, prompt: list[int], new_tokens: int, replay: Optional[list[int]], warm: set,
               reference: Optional[list[int]] = None):
    """One request on `engine` (warmed up on its first use): its output ids and measurements;
    `reference`: `ar`'s output, the text it decodes (verify.Reference: overrides at near-ties)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    warm_up(engine, prompt, warm, replay)
    ids, _, st = engine.generate(prompt, params, replay=replay, reference=reference)
    steps = st.num_steps
    per_step = max(steps + st.plain_steps + st.unready_steps + st.open_steps if engine.config.uses_draft else st.num_generated - 1, 1)
    step_ms = 1e3 * st.decode_s / per_step
    wait_ms = st.target_wait_ms_per_step  # per step that asked for a tree (unready ones too)
    verify_ms = 1e3 * st.verify_s / steps if steps else 0.0
    return ids, dict(
        tokens_per_s=st.tokens_per_s, decode_tokens_per_s=(st.num_generated - 1) / max(st.decode_s, 1e-9),
        ttft_s=st.prefill_s, mean_acceptance_length=st.mean_acceptance_length, num_steps=steps,
        plain_steps=st.plain_steps, unready_steps=st.unready_steps, lookup_skipped=st.lookup_skipped,
        step_ms=step_ms, draft_wait_ms=wait_ms, verify_ms=verify_ms,
        other_ms=max(step_ms - wait_ms - verify_ms, 0.0) if steps else step_ms,
        **st.reference_summary,
        draft_cache_tokens=st.draft_cache_tokens, tree_ready_fraction=st.tree_ready_fraction,
        retrieval_refreshes=st.retrieval_refreshes, retrieval_ms=1e3 * st.retrieval_s,
        transport_ms=st.transport_ms_per_step, draft_queue_ms=st.draft_queue_ms_per_step,
        prepared_steps=st.prepared_steps, max_step_ms=1e3 * st.max_step_s, open_steps=st.open_steps,
        draft_open_ms=1e3 * st.draft_open_s, target_prefill_ms=1e3 * st.target_prefill_s,
        mean_tree_nodes=st.mean_tree_nodes, draft_ahead_depth=st.draft_ahead_depth, probe_steps=st.probe_steps, asked_steps=st.asked_steps,
        snapshot_trees=st.snapshot_trees, ahead_steps=st.ahead_steps,
        step_kinds={k: dict(steps=n, tokens=t, ms=1e3 * sec, wait_ms=1e3 * w, forward_ms=1e3 * f)
                    for k, (n, t, sec, w, f) in st.step_kinds.items()},
        predicted_tok_per_s=st.predicted_tok_per_s, priced=st.priced, ask_ms=st.ask_ms, phase_ms=st.phase_ms,
        **wait_split(st))


def _split(kind: dict) -> str:
    """' (wait 0.61, forward 2.93, host 0.84)': a step kind's time per step, where its forwards were timed."""
    n = max(kind["steps"], 1)
    if not kind.get("forward_ms"):
        return ""
    wait, fwd = kind.get("wait_ms", 0.0) / n, kind["forward_ms"] / n
    return f" (wait {wait:.2f}, forward {fwd:.2f}, host {max(kind['ms'] / n - wait - fwd, 0.0):.2f})"


def ask_line(a: dict) -> str:
    """' (sent 0.05, call 1.10 ms: draft 0.60 of which queued 0.10 and flight 0.30; overlapped 0.40,
    back 0.05)': an early ask's way, mean ms (stats.ASK_PARTS)."""
    if not a:
        return ""
    return (f" (sent {a['sent']:.2f}, call {a['call']:.2f} ms: draft {a['draft']:.2f} of which queued {a['queued']:.2f}"
            f" and flight {a['flight']:.2f}; overlapped {a['overlap']:.2f}, back {a['back']:.2f};"
            f" waited {a.get('wait', 0.0):.2f}, p90 {a.get('wait_p90', 0.0):.2f})")


def kinds_line(r: dict) -> str:
    """'; tree 41 x 2.00 tok / 4.51 ms, lookup ...; longest 9.1 ms; draft open 480 ms (target
    prefill 310)': a request's row (run_engine's or the serve suite's): each kind of decode step's
    count, tokens and wall time per step (serving/protocol.StepKind), its longest step, and the
    draft's open against the target's prefill where a draft joined."""
    kinds = r.get("step_kinds") or {}
    if not kinds:
        return ""
    parts = [f"{k} {v['steps']} x {v['tokens'] / max(v['steps'], 1):.2f} tok / {v['ms'] / max(v['steps'], 1):.2f} ms"
             + _split(v) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["steps"])]
    out = "; " + ", ".join(parts) + f"; longest {r.get('max_step_ms', 0.0):.1f} ms"
    if r.get("ahead_steps"):  # decoded ahead of the host (plain steps ahead, lookup runs)
        out += f"; {r['ahead_steps']} ahead of the host"
    if r.get("lookup_skipped"):  # chains found at steps without a tree that the lookup gate left out
        out += f"; {r['lookup_skipped']} chains skipped"
    if r.get("mean_tree_nodes"):  # the trees verified: their size, and the pool's depth below the root when asked
        out += f"; trees of {r['mean_tree_nodes']:.1f} nodes, ahead {r.get('draft_ahead_depth', 0.0):.1f} levels"
        if r.get("asked_steps"):
            out += f", {r['asked_steps']} asked early" + ask_line(r.get("ask_ms") or {})
        if r.get("snapshot_trees"):
            out += f", {r['snapshot_trees']} from snapshots"
    tree_phases = (r.get("phase_ms") or {}).get("tree")
    if tree_phases:  # where a tree step's time goes (stats.PhaseClock), mean ms
        out += "; tree phases " + ", ".join(f"{k} {v:.2f}" for k, v in tree_phases.items())
    between = (r.get("phase_ms") or {}).get("between")
    if between:
        out += f"; between steps {between['ms']:.2f} ms"
    if r.get("predicted_tok_per_s"):  # what the policy expected of the kinds it chose (tokens a ms)
        out += "; predicted " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(r["predicted_tok_per_s"].items())) + " tok/ms"
    if r.get("draft_open_ms"):
        out += f"; draft open {r['draft_open_ms']:.0f} ms (target prefill {r.get('target_prefill_ms', 0.0):.0f})"
    return out


def wait_split(st) -> dict:
    """The target's median wait for a tree (ms) over steps answered from the overlap pool, over the
    others, and over the steps that brought the draft a retrieval selection (0.0 where none); for the
    ready steps also the median of the draft side's own time on them (arrival to answer) and of
    their queueing for the draft's thread within it (docs/architecture.md, "Wire protocol")."""
    waits = list(zip(st.wait_per_step, st.ready_per_step, st.refresh_per_step))
    ready = [(sv, q) for sv, q, r in zip(st.server_per_step, st.queued_per_step, st.ready_per_step) if r]

    def med(xs):
        return 1e3 * statistics.median(xs) if xs else 0.0
    return dict(wait_ready_ms=med([w for w, r, _ in waits if r]), wait_drafted_ms=med([w for w, r, _ in waits if not r]),
                wait_refresh_ms=med([w for w, _, f in waits if f]),
                wait_prepared_ms=med([w for w, p in zip(st.wait_per_step, st.prepared_per_step) if p]),
                ready_server_ms=med([sv for sv, _ in ready]),
                ready_queued_ms=med([q for _, q in ready]))


def run(pairs: dict[str, list[int]], modes: list[str], new_tokens: int, docs: dict[str, list[str]], dtype: str = "auto",
        tree_policy: str = "fixed", device: str = "auto", progress=print) -> dict:
    """Every mode on one prompt per document in `docs[pair]` at each pair's lengths.
    Returns {"rows": per prompt and mode, "checks": near-tie checks, "summary": mean and spread}."""
    rows, checks = [], []
    for pair_name, lengths in pairs.items():
        pair = PAIRS[pair_name]
        target, engines, anchors, workers = _engines(pair, modes, dtype, tree_policy, device)
        tol = TIE_TOLERANCE.get(target.decoder.dtype, 0.125)
        warm: set = set()
        try:
            for length in lengths:
                for doc in documents(docs[pair_name]):
                    prompt = prompt_ids(target.tokenizer, doc, length)
                    ref = None
                    for mode in modes:
                        base = dict(pair=pair_name, length=length, prompt_tokens=len(prompt), doc=doc.name, mode=mode)
                        if mode in engines:
                            spec = engines[mode].config.uses_draft
                            trace, replay = trace_for(mode, length) if spec and pair.replayed else (None, None)
                            ids, r = run_engine(engines[mode], prompt, new_tokens, replay, warm,
                                                None if mode == "ar" or replay is not None else ref)
                            r.update(replayed=replay is not None, trace=trace)
                        elif mode in anchors:
                            hf, assistant = anchors[mode]
                            ids, r = hf_anchor.generate(hf, prompt, new_tokens, assistant)
                            r.update(replayed=False, trace=None)
                        else:
                            continue
                        if mode == "ar":
                            ref = ids
                        elif ref is not None and not r["replayed"]:
                            # ar's text kept where the target chose otherwise: those overrides beyond one
                            # rounding step settled by the target's float32 logits and rounding noise there (near_tie.settle_overrides)
                            check = reference_check(target.decoder, prompt, ref, ids, overrides_of(r), tol)
                            if r.get("reference_overrides"):
                                check.update(overrides=r["reference_overrides"], max_gap=r["reference_max_gap"])
                            checks.append(dict(base, **check))
                            if check["rounding_noise"] is not None or not check["near_tie"]:
                                progress(f"{pair_name} L={length} {doc.name} {mode}: {check_line(check)}")
                        rows.append(dict(base, **r))
                        progress(f"{pair_name} L={length} {doc.name} {mode}: "
                                 f"{r['decode_tokens_per_s']:.1f} decode tok/s, TTFT {r['ttft_s']:.3f} s"
                                 + (f", acceptance {r['mean_acceptance_length']:.2f}" if "num_steps" in r else "")
                                 + kinds_line(r))
        finally:
            for w in workers:
                w.stop()
            del engines, anchors
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return dict(rows=rows, checks=checks, summary=summarize(rows))


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(rows: list[dict]) -> list[dict]:
    """Mean and spread (sample standard deviation) over prompts per (pair, length, mode); `x_ar` is
    the mean over prompts of decode tok/s over `ar`'s on the same prompt."""
    ar = {(r["pair"], r["length"], r["doc"]): r["decode_tokens_per_s"] for r in rows if r["mode"] == "ar"}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["pair"], r["length"], r["mode"]), []).append(r)
    out = []
    for (pair, length, mode), rs in groups.items():
        s = dict(pair=pair, length=length, mode=mode, prompts=len(rs), replayed=any(r["replayed"] for r in rs),
                 prompt_tokens=round(statistics.fmean(r["prompt_tokens"] for r in rs)))
        for key in ("decode_tokens_per_s", "tokens_per_s", "ttft_s", "mean_acceptance_length", "step_ms",
                    "draft_wait_ms", "verify_ms", "other_ms", "transport_ms", "draft_queue_ms"):
            vals = [r[key] for r in rs if key in r]
            if vals:
                s[key], s[key + "_std"] = _stats(vals)
        ratios = [r["decode_tokens_per_s"] / ar[k] for r in rs
                  if (k := (pair, length, r["doc"])) in ar and ar[k] > 0]
        if ratios:
            s["x_ar"], s["x_ar_std"] = _stats(ratios)
        out.append(s)
    return out


def table(result: dict) -> str:
    """Markdown table of the summary: mean ± spread over prompts."""
    def pm(s, key, fmt):
        return f"{fmt.format(s[key])} ± {fmt.format(s[key + '_std'])}" if key in s else "-"

    lines = ["| pair | L | mode | prompts | decode tok/s | x ar | TTFT s | mean acc. len | step ms "
             "(draft wait [of which transport] / verify / other) |", "|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        wait = f"{s['draft_wait_ms']:.2f}" if "step_ms" in s else ""
        if s.get("transport_ms"):  # runs from before the draft reported its own time have none
            wait += f" [{s['transport_ms']:.2f}]"
        split = (f"{s['step_ms']:.2f} ({wait} / {s['verify_ms']:.2f} / {s['other_ms']:.2f})"
                 if "step_ms" in s else "-")
        lines.append(f"| {s['pair']} | {s['length']} | {s['mode']}{' (replayed)' if s['replayed'] else ''} | "
                     f"{s['prompts']} | {pm(s, 'decode_tokens_per_s', '{:.1f}')} | {pm(s, 'x_ar', '{:.2f}')} | "
                     f"{pm(s, 'ttft_s', '{:.3f}')} | {pm(s, 'mean_acceptance_length', '{:.2f}')} | {split} |")
    bad = [c for c in result["checks"] if c["near_tie"] is False]
    open_ = [c for c in result["checks"] if c["near_tie"] is None]  # recorded before differing outputs were settled
    if result["checks"]:
        lines.append("")
        lines.append(f"Lossless checks: {len(result['checks'])} outputs of the other modes against `ar`, "
                     f"{sum(c['identical'] for c in result['checks'])} identical, "
                     f"{len(result['checks']) - len(bad) - len(open_)} identical or first differing at a near-tie, "
                     f"{len(bad)} not" + (f", {len(open_)} differing but not checked by the near-tie rule." if open_ else "."))
        forced = [c for c in result["checks"] if c.get("overrides")]
        if forced:  # the serve suite's apps decode served ar's text (verify.Reference)
            lines.append(f"Served ar's tokens overrode the target's choice at {sum(c['overrides'] for c in forced)} "
                         f"places in {len(forced)} outputs, top-two gaps at most "
                         f"{max(c['max_gap'] for c in forced):.3f}.")
    return "\n".join(lines)
